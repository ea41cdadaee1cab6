//! One worker per user, across every process sharing the store, each run holding its slot for a
//! limited time (a sandbox VM per user, say: never two at once). A job asks
//! [`RateLimiter::acquire`] for the user's slot; the [`Permit`] holds it while the job runs and
//! frees it when dropped. A process that crashes mid-job never says so: its lease ends, and the
//! slot with it.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example worker   # run it twice at once
//! ```

use std::time::Duration;

use tower_redis_ratelimit::{MemoryStore, Permit, Policy, RateLimiter, RedisStore, Refused, Store};

/// One run per user at a time, none holding its slot longer than `lease`.
fn workers(store: impl Store, lease: Duration) -> RateLimiter {
    let policy = Policy::builder("user-worker")
        .max_in_flight(1)
        .lease(lease)
        .build()
        .expect("a valid policy");
    RateLimiter::new(policy, store)
}

/// Runs `user`'s job if no other process runs one: the slot is held while `work` runs.
async fn run_job<F: Future<Output = ()>>(
    workers: &RateLimiter,
    user: &str,
    work: F,
) -> Result<(), Refused> {
    let permit: Permit = workers.acquire(user).await?;
    work.await;
    // Dropping it would free it too; releasing waits until every process can see it free.
    if let Err(error) = permit.release().await {
        eprintln!("the slot frees when its lease ends: {error}");
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    let workers = match std::env::var("REDIS_URL") {
        Ok(url) => workers(
            RedisStore::from_url(&url).expect("a valid REDIS_URL"),
            Duration::from_secs(30),
        ),
        Err(_) => workers(MemoryStore::new(), Duration::from_secs(30)),
    };
    for round in 1..=3 {
        let job = tokio::time::sleep(Duration::from_secs(2));
        match run_job(&workers, "ann", job).await {
            Ok(()) => println!("round {round}: ran ann's job"),
            Err(busy) => println!(
                "round {round}: another process runs ann's job; free in {:?}",
                busy.retry_after()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two processes, one store: while one runs a user's job the other is refused; a crash
    /// (the permit never released) holds the slot until its lease ends.
    #[tokio::test]
    async fn one_job_per_user_across_processes_and_a_crash_is_recovered_by_the_lease() {
        let store = MemoryStore::new();
        let lease = Duration::from_millis(300);
        let (first, second) = (workers(store.clone(), lease), workers(store, lease));
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        let running = {
            let first = first.clone();
            tokio::spawn(async move {
                run_job(&first, "ann", async move {
                    let _ = finished.await;
                })
                .await
            })
        };
        // Give the first process its slot, then try from the second.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let busy = run_job(&second, "ann", async {}).await.unwrap_err();
        assert!(busy.retry_after().unwrap() <= lease);
        assert!(
            run_job(&second, "bob", async {}).await.is_ok(),
            "bob's own slot"
        );
        finish.send(()).unwrap();
        running.await.unwrap().unwrap();
        assert!(
            run_job(&second, "ann", async {}).await.is_ok(),
            "freed by the first"
        );

        // The first process crashes mid-job: its permit is never released.
        let permit = first.acquire("ann").await.unwrap();
        std::mem::forget(permit);
        assert!(second.acquire("ann").await.is_err());
        tokio::time::sleep(lease + Duration::from_millis(50)).await;
        assert!(second.acquire("ann").await.is_ok(), "the lease ended");
    }
}
