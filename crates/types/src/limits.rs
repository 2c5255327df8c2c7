//! Size bounds that every entry point enforces. A request past them is refused before it reaches
//! the log, with the bound in the message.

/// Largest key, in bytes.
pub const KEY_BYTES_MAX: usize = 4 * 1024;
/// Largest value, in bytes.
pub const VALUE_BYTES_MAX: usize = 1024 * 1024;
/// Most keys in one batch request (get, exists, put, delete, insert-if-absent).
pub const BATCH_KEYS_MAX: usize = 10_000;
/// Largest sum of key and value bytes in one batch request.
pub const BATCH_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Longest TTL, in milliseconds: 10 years of 365.25 days, as `10y` reads in the human
/// durations that `cairnctl` and the configuration take.
pub const TTL_MS_MAX: u64 = 10 * 31_557_600 * 1000;
