//! A token bucket shared by every transfer of a repository, uploads and downloads, so that
//! snapshots being published, restored or loaded for a move cannot take the whole network link
//! from the node's foreground traffic.
//!
//! The bucket holds at most one second's worth of bytes. A caller takes the bytes it is about to
//! send, even more than the bucket holds (a whole multipart part), and then sleeps off the debt:
//! concurrent callers queue up behind each other's debt, so the total rate stays at the limit.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

pub(crate) struct RateLimiter {
    bytes_per_second: f64,
    bucket: Mutex<Bucket>,
}

struct Bucket {
    /// Negative when callers have taken more than there was: that is the debt still to sleep off.
    tokens: f64,
    refilled_at: Instant,
}

impl RateLimiter {
    /// `bytes_per_second` must be positive; the options check it.
    pub(crate) fn new(bytes_per_second: u64) -> RateLimiter {
        assert!(bytes_per_second > 0, "a rate limit of 0 bytes per second");
        let rate = bytes_per_second as f64;
        RateLimiter {
            bytes_per_second: rate,
            bucket: Mutex::new(Bucket {
                tokens: rate,
                refilled_at: Instant::now(),
            }),
        }
    }

    /// Waits until `bytes` may be sent.
    pub(crate) async fn acquire(&self, bytes: u64) {
        let wait = {
            // A panic while holding this lock leaves plain numbers behind; they are still usable.
            let mut bucket = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let refill = (now - bucket.refilled_at).as_secs_f64() * self.bytes_per_second;
            bucket.tokens = (bucket.tokens + refill).min(self.bytes_per_second);
            bucket.refilled_at = now;
            bucket.tokens -= bytes as f64;
            if bucket.tokens < 0.0 {
                Duration::from_secs_f64(-bucket.tokens / self.bytes_per_second)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

/// A reader that pays for what it read before handing it on, when there is a limit: for copies
/// made on a blocking thread (to or from a local repository), which wait for the bucket there.
pub(crate) struct LimitedRead<R> {
    inner: R,
    /// The limiter, and the runtime whose clock it sleeps on.
    limit: Option<(std::sync::Arc<RateLimiter>, tokio::runtime::Handle)>,
}

impl<R> LimitedRead<R> {
    /// Made on one of the runtime's blocking threads, whose runtime the limiter sleeps on; with
    /// no limiter, `inner` as it is.
    pub(crate) fn new(inner: R, limiter: Option<std::sync::Arc<RateLimiter>>) -> LimitedRead<R> {
        LimitedRead {
            inner,
            limit: limiter.map(|limiter| (limiter, tokio::runtime::Handle::current())),
        }
    }
}

impl<R: std::io::Read> std::io::Read for LimitedRead<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let read = self.inner.read(buf)?;
        if let Some((limiter, runtime)) = &self.limit {
            runtime.block_on(limiter.acquire(read as u64));
        }
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_one_second_then_the_rate() {
        let limiter = RateLimiter::new(1000);
        let start = Instant::now();
        limiter.acquire(1000).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        limiter.acquire(1000).await;
        limiter.acquire(1000).await;
        let elapsed = start.elapsed().as_secs_f64();
        assert!((1.99..2.01).contains(&elapsed), "{elapsed}");
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_callers_share_the_rate() {
        let limiter = Arc::new(RateLimiter::new(1000));
        let start = Instant::now();
        let tasks: Vec<_> = (0..5)
            .map(|_| {
                let limiter = limiter.clone();
                tokio::spawn(async move { limiter.acquire(1000).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        // 5000 bytes at 1000 bytes/s with a 1000-byte burst: the last one finishes after 4 s.
        let elapsed = start.elapsed().as_secs_f64();
        assert!((3.99..4.01).contains(&elapsed), "{elapsed}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_part_larger_than_the_bucket_is_paid_off_in_time() {
        let limiter = RateLimiter::new(1000);
        let start = Instant::now();
        limiter.acquire(5000).await;
        let elapsed = start.elapsed().as_secs_f64();
        assert!((3.99..4.01).contains(&elapsed), "{elapsed}");
    }
}
