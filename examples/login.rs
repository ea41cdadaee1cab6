//! Login abuse, as OWASP and rate-limiter-flexible's login recipe count it: failures per username
//! (5 per 15 minutes) and failures per client IP (100 a day). The username is in the form body,
//! so no layer can key on it: the handler asks a [`RateLimiter`] before it checks the password
//! (every attempt is charged up front, so concurrent guesses can't pass the limit), a refused
//! attempt never reaches the password hash, and a success gives its own attempt back by its
//! receipt ([`Admitted::refund`]): exactly that unit, in the window it was charged. The per-IP
//! limit is a layer that counts only failed logins (`count_only`), which gives a success's charge
//! back the same way.
//!
//! ```text
//! cargo run --example login     # serves 127.0.0.1:3004 (REDIS_URL: counts in Redis)
//! for i in $(seq 1 7); do curl -s -o /dev/null -w "%{http_code} " -d 'username=ann&password=x' 127.0.0.1:3004/login; done
//! # 401 401 401 401 401 429 429
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Form, State};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Router, http::StatusCode};
use tower_redis_ratelimit::{
    Admitted, Key, MemoryStore, Policy, RateLimitLayer, RateLimiter, RedisStore, Refused, Rule,
    Store,
};

#[derive(serde::Deserialize)]
struct Login {
    username: String,
    password: String,
}

#[derive(Clone)]
struct Accounts {
    /// Failed logins per username.
    failures: RateLimiter,
    /// How many times the (expensive) password hash ran: what a refusal spares.
    hashed: Arc<AtomicUsize>,
}

impl Accounts {
    /// The password check: in a real app an Argon2 or bcrypt verification, tens of milliseconds.
    fn verify(&self, login: &Login) -> bool {
        self.hashed.fetch_add(1, Ordering::Relaxed);
        login.username == "ann" && login.password == "correct horse"
    }
}

async fn login(
    State(accounts): State<Accounts>,
    Form(login): Form<Login>,
) -> Result<impl IntoResponse, Refused> {
    // Charged before the hash runs: 5 wrong passwords and the 6th attempt is refused, whatever
    // its password, until the oldest failure is 15 minutes old.
    let admitted: Admitted = accounts.failures.check(&login.username).await?;
    if accounts.verify(&login) {
        // A success is no failure: its own unit goes back (best effort: a store error leaves it
        // counted).
        let _ = admitted.refund().await;
        Ok((StatusCode::OK, "welcome\n").into_response())
    } else {
        Ok((
            StatusCode::UNAUTHORIZED,
            admitted,
            "wrong username or password\n",
        )
            .into_response())
    }
}

/// The app: failures per username, and failed logins per client IP (`per_ip_per_day`).
fn app(store: impl Store + Clone, per_ip_per_day: u64) -> (Router, Arc<AtomicUsize>) {
    let by_username = Policy::builder("login-username")
        .rule(Rule::new(5, Duration::from_secs(15 * 60)))
        .message("Too many failed logins for this account; try again later.")
        .build()
        .expect("a valid policy");
    let by_ip = Policy::builder("login-ip")
        .key(Key::ip())
        .rule(Rule::per_day(per_ip_per_day))
        .count_only(|status| status == StatusCode::UNAUTHORIZED)
        .message("Too many failed logins from this address; try again tomorrow.")
        .build()
        .expect("a valid policy");
    let hashed = Arc::new(AtomicUsize::new(0));
    let accounts = Accounts {
        failures: RateLimiter::new(by_username, store.clone()),
        hashed: hashed.clone(),
    };
    let router = Router::new()
        .route("/login", post(login))
        .with_state(accounts)
        .layer(RateLimitLayer::new(by_ip, store));
    (router, hashed)
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let (app, _) = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url).expect("a valid REDIS_URL"), 100),
        Err(_) => app(MemoryStore::new(), 100),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3004").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::body::Body;
    use axum::extract::ConnectInfo;
    use http::Request;
    use tower::ServiceExt;

    async fn attempt(app: &Router, from: &str, body: &str) -> http::Response<Body> {
        let mut request = Request::post("/login")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(body.to_owned()))
            .unwrap();
        let peer: SocketAddr = from.parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        app.clone().oneshot(request).await.unwrap()
    }

    #[tokio::test]
    async fn five_failures_then_refused_without_hashing() {
        let (app, hashed) = app(MemoryStore::new(), 100);
        let wrong = "username=ann&password=guess";
        let mut statuses = Vec::new();
        for _ in 0..7 {
            let response = attempt(&app, "192.0.2.1:5000", wrong).await;
            // Every answer carries the username's state, the refusals Retry-After too.
            assert!(response.headers().contains_key("ratelimit"), "{response:?}");
            statuses.push(response.status().as_u16());
        }
        assert_eq!(statuses, [401, 401, 401, 401, 401, 429, 429]);
        assert_eq!(
            hashed.load(Ordering::Relaxed),
            5,
            "refused attempts never hash"
        );
        // Another account is its own count.
        let bob = "username=bob&password=x";
        assert_eq!(attempt(&app, "192.0.2.2:5000", bob).await.status(), 401);
    }

    #[tokio::test]
    async fn a_success_gives_back_its_own_attempt_not_the_failures_before_it() {
        let (app, _) = app(MemoryStore::new(), 100);
        let (wrong, right) = (
            "username=ann&password=guess",
            "username=ann&password=correct+horse",
        );
        let mut statuses = Vec::new();
        for body in [
            wrong, wrong, wrong, right, wrong, wrong, wrong, wrong, wrong, wrong,
        ] {
            statuses.push(
                attempt(&app, "192.0.2.3:5000", body)
                    .await
                    .status()
                    .as_u16(),
            );
        }
        // Three failures, a success (its attempt given back), two more failures: five, and the
        // next attempt is refused, the right password's too.
        assert_eq!(statuses, [401, 401, 401, 200, 401, 401, 429, 429, 429, 429]);
        let response = attempt(&app, "192.0.2.3:5000", right).await;
        assert_eq!(response.status(), 429);
    }

    #[tokio::test]
    async fn failures_from_one_address_are_capped_across_usernames() {
        let (app, _) = app(MemoryStore::new(), 3);
        let mut statuses = Vec::new();
        for user in ["a", "b", "c", "d", "e"] {
            let body = format!("username={user}&password=guess");
            statuses.push(
                attempt(&app, "198.51.100.4:1", &body)
                    .await
                    .status()
                    .as_u16(),
            );
        }
        assert_eq!(statuses, [401, 401, 401, 429, 429]);
        // A success from another address doesn't count there.
        let right = "username=ann&password=correct+horse";
        assert_eq!(attempt(&app, "198.51.100.5:1", right).await.status(), 200);
        assert_eq!(attempt(&app, "198.51.100.5:1", right).await.status(), 200);
    }
}
