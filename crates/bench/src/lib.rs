//! What the benchmark binaries share: the plain copies they measure against, progress lines on
//! stderr, and the way their reports show sizes and times. moto's S3 server comes from
//! `cairn_snapshots::test_util::moto`, shared with the tests.
//!
//! Architecture invariant: nothing here measures anything; each binary owns its figures.

pub mod copy;
pub mod report;
