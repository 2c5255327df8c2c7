//! Generates the Rust code of the `cairn.v1` protocol from `proto/`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tonic_prost_build::configure().bytes(".").compile_protos(
        &["proto/cairn/v1/kv.proto", "proto/cairn/v1/admin.proto"],
        &["proto"],
    )?;
    Ok(())
}
