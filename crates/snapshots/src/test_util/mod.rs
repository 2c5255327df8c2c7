//! What tests and benchmarks share (feature `test-util`): moto's S3 server launcher. The hooks
//! that stand for crashes and the raw object-store access live beside the code they bypass
//! ([`crate::PublishOptions::stop_after`], [`crate::SnapshotRepository::upload_plain`],
//! [`crate::SnapshotRepository::object_store`]), behind the same feature.

pub mod moto;
