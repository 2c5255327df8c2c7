//! What the benchmark binaries share: moto's S3 server, the plain copies they measure against,
//! progress lines on stderr, and the way their reports show sizes and times.
//!
//! Architecture invariant: nothing here measures anything; each binary owns its figures.

pub mod copy;
// The same moto launcher as the tests'.
#[path = "../../snapshots/tests/support/moto.rs"]
pub mod moto;
pub mod report;
