//! The gRPC protocol of Cairn, generated from `proto/cairn/v1/*.proto`.
//!
//! Architecture invariant: only wire types live here; no behaviour. The server (`cairn-node`) and
//! the client (`cairn-client`) both build on it.

pub mod v1 {
    tonic::include_proto!("cairn.v1");
}

/// Largest gRPC message either side accepts: a full batch plus framing.
pub const MESSAGE_BYTES_MAX: usize = 24 * 1024 * 1024;
