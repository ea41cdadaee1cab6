//! Calls a rate-limited HTTP endpoint through the outbound layer: `--requests` GETs to `--target`,
//! `--concurrency` in flight at once, never more than `--limit` allows (several `--limit` flags are
//! several rules, all kept), honouring the upstream's `Retry-After` / `RateLimit` headers.
//!
//! ```text
//! cargo run --example outbound -- --target http://127.0.0.1:PORT/path --requests 60 --concurrency 10 \
//!     --limit 5/1s [--store redis://127.0.0.1:6379/0] [--max-wait 30s]
//! ```
//!
//! Prints one line per request, in the order they were started: `<status> <elapsed ms>ms` (when
//! its answer came, since the start), or
//! `error <elapsed ms>ms: <why>` for a request that got no answer (its slot was further away than
//! `--max-wait`, the connection failed), and exits 0 when every request got an answer other than
//! 429. Two copies started at once with the same `--store` share the limit: their keys are the
//! same (`outbound:example:upstream:<host:port>`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, service_fn};
use tower_redis_ratelimit::outbound::OutboundLayer;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, RedisStore, Rule, Store};

const USAGE: &str = "\
usage: cargo run --example outbound -- --target URL --limit N/PERIOD [--limit N/PERIOD ...]
           [--requests N (default 60)] [--concurrency N (default 10)]
           [--store memory|redis://host:port/db (default memory)] [--max-wait PERIOD (default 30s)]
PERIOD: a whole number and ms, s, m, h or d (\"500ms\", \"1s\", \"1m\").";

/// The command line.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    target: String,
    requests: usize,
    concurrency: usize,
    limits: Vec<(u64, Duration)>,
    store: String,
    max_wait: Duration,
}

fn parse_options(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut options = Options {
        target: String::new(),
        requests: 60,
        concurrency: 10,
        limits: Vec::new(),
        store: "memory".into(),
        max_wait: Duration::from_secs(30),
    };
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--target" => options.target = value()?,
            "--requests" => options.requests = number(&flag, &value()?)?,
            "--concurrency" => options.concurrency = number::<usize>(&flag, &value()?)?.max(1),
            "--limit" => options.limits.push(parse_limit(&value()?)?),
            "--store" => options.store = value()?,
            "--max-wait" => options.max_wait = parse_period(&value()?)?,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if options.target.is_empty() {
        return Err(format!("--target is required\n{USAGE}"));
    }
    if options.limits.is_empty() {
        return Err(format!("at least one --limit is required\n{USAGE}"));
    }
    Ok(options)
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{flag}: {text:?} is not a whole number"))
}

/// `5/1s`: a limit and its period.
fn parse_limit(text: &str) -> Result<(u64, Duration), String> {
    let (limit, period) = text
        .split_once('/')
        .ok_or(format!("--limit: {text:?} is not N/PERIOD, such as 5/1s"))?;
    Ok((number("--limit", limit)?, parse_period(period)?))
}

/// `500ms`, `1s`, `2m`, `1h`, `1d`.
fn parse_period(text: &str) -> Result<Duration, String> {
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let amount: u64 = text[..digits]
        .parse()
        .map_err(|_| format!("{text:?} is not a period such as 500ms, 1s or 1m"))?;
    let unit_ms = match &text[digits..] {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{text:?} is not a period such as 500ms, 1s or 1m")),
    };
    Ok(Duration::from_millis(amount.saturating_mul(unit_ms)))
}

type Client = BoxCloneSyncService<Request<String>, Response<String>, BoxError>;

fn client(options: &Options) -> Result<Client, String> {
    let policy = Policy::builder("example")
        .prefix("outbound")
        .algorithm(Algorithm::SlidingLog)
        .rules(
            options
                .limits
                .iter()
                .map(|&(limit, period)| Rule::new(limit, period)),
        )
        .build()
        .map_err(|error| format!("--limit: {error}"))?;
    let store: Arc<dyn Store> = if options.store == "memory" {
        Arc::new(MemoryStore::new())
    } else {
        let store =
            RedisStore::from_url(&options.store).map_err(|error| format!("--store: {error}"))?;
        Arc::new(store.timeout(Duration::from_secs(2)))
    };
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .map_err(|error| error.to_string())?;
    let send = service_fn(move |request: Request<String>| {
        let http = http.clone();
        async move {
            let response = http.execute(reqwest::Request::try_from(request)?).await?;
            let mut answer = Response::builder().status(response.status().as_u16());
            for (name, value) in response.headers() {
                answer = answer.header(name.as_str(), value.as_bytes());
            }
            Ok::<_, BoxError>(answer.body(response.text().await?)?)
        }
    });
    let limited = ServiceBuilder::new()
        .layer(OutboundLayer::new(policy, store).max_wait(options.max_wait))
        .service(send);
    Ok(BoxCloneSyncService::new(limited))
}

/// Sends the requests, printing a line per response; whether every one got a non-429 answer.
async fn run(options: &Options) -> Result<bool, String> {
    let client = client(options)?;
    let started = Instant::now();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(options.concurrency));
    let tasks: Vec<_> = (0..options.requests)
        .map(|_| {
            let (mut client, target, semaphore) =
                (client.clone(), options.target.clone(), semaphore.clone());
            tokio::spawn(async move {
                let _permit = semaphore.acquire_owned().await.expect("never closed");
                let request = Request::get(&target).body(String::new())?;
                let response = client.ready().await?.call(request).await;
                let elapsed = started.elapsed().as_millis();
                Ok::<_, BoxError>((response.map(|response| response.status().as_u16()), elapsed))
            })
        })
        .collect();
    let mut all_answered = true;
    for task in tasks {
        let (answer, elapsed) = task
            .await
            .map_err(|error| error.to_string())?
            .map_err(|error| error.to_string())?;
        match answer {
            Ok(status) => {
                println!("{status} {elapsed}ms");
                all_answered &= status != 429;
            }
            Err(error) => {
                println!("error {elapsed}ms: {error}");
                all_answered = false;
            }
        }
    }
    Ok(all_answered)
}

#[tokio::main]
async fn main() -> ExitCode {
    let options = match parse_options(std::env::args().skip(1)) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    match run(&options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(text: &str) -> impl Iterator<Item = String> {
        text.split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn the_command_line_of_the_contract_parses() {
        let options = parse_options(args(
            "--target http://127.0.0.1:9/x --requests 60 --concurrency 10 --limit 5/1s \
             --limit 100/1m --store redis://127.0.0.1:6379/0 --max-wait 30s",
        ))
        .unwrap();
        assert_eq!(
            options,
            Options {
                target: "http://127.0.0.1:9/x".into(),
                requests: 60,
                concurrency: 10,
                limits: vec![(5, Duration::from_secs(1)), (100, Duration::from_secs(60))],
                store: "redis://127.0.0.1:6379/0".into(),
                max_wait: Duration::from_secs(30),
            }
        );
        for (bad, message) in [
            ("--limit 5/1s", "--target is required"),
            ("--target http://x", "at least one --limit is required"),
            (
                "--target http://x --limit 5",
                "--limit: \"5\" is not N/PERIOD, such as 5/1s",
            ),
            (
                "--target http://x --limit 5/1y",
                "\"1y\" is not a period such as 500ms, 1s or 1m",
            ),
            (
                "--target http://x --limit 5/1s --requests",
                "--requests needs a value",
            ),
        ] {
            let error = parse_options(args(bad)).unwrap_err();
            assert!(error.starts_with(message), "{bad}: {error}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_requests_at_five_a_second_all_get_answers_and_take_a_second() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = format!("http://{}/quote", listener.local_addr().unwrap());
        let app = axum::Router::new().route("/quote", axum::routing::get(|| async { "42" }));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let options = parse_options(args(&format!(
            "--target {target} --requests 10 --concurrency 10 --limit 5/1s"
        )))
        .unwrap();
        let started = Instant::now();
        assert!(run(&options).await.unwrap());
        assert!(started.elapsed() >= Duration::from_secs(1));

        // A slot past the maximum wait is an error, and the run says so.
        let options = parse_options(args(&format!(
            "--target {target} --requests 10 --concurrency 10 --limit 5/1s --max-wait 100ms"
        )))
        .unwrap();
        assert!(!run(&options).await.unwrap());
    }
}
