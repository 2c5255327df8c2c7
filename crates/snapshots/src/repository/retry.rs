//! Retries with exponential backoff and jitter, for whole-object operations (an upload, a download,
//! a HEAD) whose failure is transient.
//!
//! The S3 client below retries single requests itself (a failed multipart part is retried alone);
//! this loop restarts an operation that still failed, from its beginning. Both are bounded by the
//! repository's `retries`.

use crate::Result;
use rand::Rng;
use std::future::Future;
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryPolicy {
    pub(crate) retries: u32,
    pub(crate) initial_backoff: Duration,
    pub(crate) max_backoff: Duration,
}

impl RetryPolicy {
    pub(crate) fn new(retries: u32) -> RetryPolicy {
        RetryPolicy {
            retries,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
        }
    }

    /// The pause before retry number `attempt` (0-based): the exponential delay, capped, with
    /// "equal jitter" (between half and all of it) so that many failed uploads do not retry in
    /// lockstep.
    pub(crate) fn backoff(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let exponential = self
            .initial_backoff
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.max_backoff);
        let half = exponential / 2;
        half + half.mul_f64(rng.random::<f64>())
    }

    /// Runs `operation` until it succeeds, fails with a permanent error, or has been retried
    /// `retries` times. `what` names the operation in logs.
    pub(crate) async fn run<T, F, Fut>(&self, what: &str, mut operation: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut attempt = 0;
        loop {
            match operation().await {
                Ok(value) => return Ok(value),
                Err(err) if attempt < self.retries && err.is_transient() => {
                    let pause = self.backoff(attempt, &mut rand::rng());
                    tracing::warn!(
                        operation = what,
                        attempt = attempt + 1,
                        retries = self.retries,
                        ?pause,
                        error = %err,
                        "retrying after a transient failure"
                    );
                    tokio::time::sleep(pause).await;
                    attempt += 1;
                }
                Err(err) => return Err(err),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use rand::SeedableRng;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn backoff_grows_exponentially_with_jitter_and_is_capped() {
        let policy = RetryPolicy::new(5);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for attempt in 0..30 {
            let base = Duration::from_millis(100)
                .saturating_mul(1 << attempt.min(20))
                .min(Duration::from_secs(10));
            let pause = policy.backoff(attempt, &mut rng);
            assert!(pause >= base / 2 && pause <= base, "{attempt}: {pause:?}");
        }
    }

    fn transient() -> Error {
        Error::ObjectStore {
            context: "put",
            location: "memory:///x".into(),
            source: object_store::Error::Generic {
                store: "test",
                source: "connection reset".into(),
            },
        }
    }

    #[tokio::test(start_paused = true)]
    async fn transient_errors_are_retried_up_to_the_bound() {
        let policy = RetryPolicy::new(3);
        let calls = AtomicU32::new(0);
        let result: Result<()> = policy
            .run("test", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(transient())
            })
            .await;
        assert!(result.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 4);

        let calls = AtomicU32::new(0);
        let result = policy
            .run("test", || async {
                if calls.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(transient())
                } else {
                    Ok(42)
                }
            })
            .await;
        assert_eq!(result.unwrap(), 42);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_errors_are_not_retried() {
        let policy = RetryPolicy::new(3);
        let calls = AtomicU32::new(0);
        let result: Result<()> = policy
            .run("test", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(Error::InvalidOptions {
                    reason: "no".into(),
                })
            })
            .await;
        assert!(result.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
