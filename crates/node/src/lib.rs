//! A Cairn node: loads its configuration, opens its log, metadata and partition stores, starts a
//! processor per partition, takes leadership of its partitions and serves gRPC on one port.
//!
//! Architecture invariant: this crate wires the parts together and translates between the wire
//! protocol and the worker; it holds no storage logic of its own.

mod background;
mod cluster;
pub mod config;
mod connections;
mod forward;
mod metrics;
mod node;
mod open_files;
mod operations;
mod partitions;
mod resp;
mod scaling;
mod service;
pub mod tools;
mod validate;

pub use cairn_types::PartitionId;
pub use config::{Config, ConfigError, Overrides};
pub use node::{RunningNode, start};
