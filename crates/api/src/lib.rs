//! The gRPC protocol of Cairn, generated from `proto/cairn/v1/*.proto`.
//!
//! Architecture invariant: only wire types live here; no behaviour. The server (`cairn-node`) and
//! the client (`cairn-client`) both build on it.

pub mod v1 {
    tonic::include_proto!("cairn.v1");
}

/// Largest gRPC message either side accepts: a full batch plus framing.
pub const MESSAGE_BYTES_MAX: usize = 24 * 1024 * 1024;

/// The metadata header of a key-value call from a client that routes by itself
/// (`cairn_client::RoutingClient`): a node that does not lead the call's partitions refuses it
/// with `UNAVAILABLE` instead of forwarding it, so that the client reads the partition table again
/// and learns the new leader, instead of paying a forwarding hop for as long as it runs.
pub const ROUTED_HEADER: &str = "cairn-routed";
