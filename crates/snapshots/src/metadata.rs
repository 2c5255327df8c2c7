//! `metadata.json`: what a snapshot holds and what a restore needs to trust it.
//!
//! The fields and their names are those of RocksDB's column family export, as in seed 000's sample
//! (`files[]` are the exported SST files with their levels, key ranges and sequence numbers), plus
//! what Cairn adds: `log_id` (the log to replay from `min_applied_lsn + 1`), and per file a
//! `checksum` and the object `key` under which the repository keeps it. An export carries neither;
//! [`crate::SnapshotRepository::publish`] fills them in.
//!
//! Readers tolerate unknown fields, so a newer writer may add some. They refuse an unknown
//! `version`: a new version means the old reader cannot interpret the snapshot safely.

use crate::{Error, Result, SnapshotId};
use cairn_types::{KeyRange, LogId, Lsn, PartitionId};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::time::SystemTime;

/// The only version this build reads and writes.
pub const METADATA_VERSION: &str = "V1";

/// Version of the `metadata.json` format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum MetadataVersion {
    #[default]
    V1,
}

/// The content of a snapshot's `metadata.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotMetadata {
    pub version: MetadataVersion,
    pub cluster_name: String,
    pub partition_id: PartitionId,
    pub node_name: String,
    /// When the snapshot was taken; written as RFC 3339 with nanoseconds, e.g.
    /// `2024-09-26T07:31:49.264522000Z`.
    #[serde(with = "rfc3339")]
    pub created_at: SystemTime,
    pub snapshot_id: SnapshotId,
    /// The inclusive range of partition keys that the partition owned when the snapshot was taken.
    pub key_range: KeyRange,
    /// Every record up to and including this LSN is in the snapshot; a restore replays the log from
    /// the next one.
    pub min_applied_lsn: Lsn,
    pub db_comparator_name: String,
    pub files: Vec<SnapshotFile>,
    /// The log whose records the snapshot has applied up to `min_applied_lsn`.
    pub log_id: LogId,
    /// When the cluster that took the snapshot was created: tells apart two clusters of the same
    /// name (say, one recreated on a reset base dir) whose snapshots share a repository, and
    /// whose LSNs mean different records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_created_at: Option<String>,
    /// What publishing this snapshot uploaded; absent before it is published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<PublishStats>,
}

/// One exported SST file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotFile {
    pub column_family_name: String,
    /// The file's name as RocksDB reports it, with a leading slash: `/000030.sst`.
    pub name: String,
    /// The export folder on the node that took the snapshot; informational only.
    pub directory: String,
    pub size: u64,
    pub level: i32,
    /// Smallest key in the file, hex-encoded.
    pub start_key: String,
    /// Largest key in the file, hex-encoded.
    pub end_key: String,
    pub smallest_seqno: u64,
    pub largest_seqno: u64,
    pub num_entries: u64,
    pub num_deletions: u64,
    /// Checksum of the file's bytes; set by publish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<Checksum>,
    /// Where the repository keeps the file, relative to the partition's folder
    /// (`ssts/<content hash>.sst`); set by publish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// What publishing a snapshot uploaded. Files already in the repository (shared with an older
/// snapshot) are not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PublishStats {
    pub uploaded_files: u64,
    pub uploaded_bytes: u64,
}

/// Checks the `version` of a `metadata.json` or `latest.json` before anything else is decoded: a
/// future version may change any other field, and its reader must say "unsupported version", not
/// "missing field". `location` names the object in errors.
pub(crate) fn check_version(bytes: &[u8], location: &str) -> Result<()> {
    #[derive(Deserialize)]
    struct VersionOnly {
        version: Option<serde_json::Value>,
    }
    let probe: VersionOnly =
        serde_json::from_slice(bytes).map_err(|source| Error::UndecodableMetadata {
            location: location.into(),
            source,
        })?;
    match probe.version {
        Some(serde_json::Value::String(v)) if v == METADATA_VERSION => Ok(()),
        Some(serde_json::Value::String(found)) => Err(Error::UnsupportedVersion {
            location: location.into(),
            found,
        }),
        Some(other) => Err(Error::UnsupportedVersion {
            location: location.into(),
            found: other.to_string(),
        }),
        None => Err(Error::MalformedMetadata {
            location: location.into(),
            reason: "it has no `version` field".into(),
        }),
    }
}

impl SnapshotMetadata {
    /// Decodes a `metadata.json`, refusing versions other than V1.
    pub fn from_json(bytes: &[u8]) -> Result<SnapshotMetadata> {
        Self::from_json_at(bytes, "metadata.json")
    }

    /// Like [`SnapshotMetadata::from_json`]; `location` names the object in errors.
    pub(crate) fn from_json_at(bytes: &[u8], location: &str) -> Result<SnapshotMetadata> {
        let malformed = |reason: String| Error::MalformedMetadata {
            location: location.into(),
            reason,
        };
        check_version(bytes, location)?;
        let metadata: SnapshotMetadata =
            serde_json::from_slice(bytes).map_err(|source| Error::UndecodableMetadata {
                location: location.into(),
                source,
            })?;
        metadata
            .validate()
            .map_err(|problem| malformed(problem.to_string()))?;
        Ok(metadata)
    }

    /// Encodes as pretty-printed JSON, the form kept in the repository.
    pub fn to_json_pretty(&self) -> Vec<u8> {
        // Serializing plain structs with string keys cannot fail.
        serde_json::to_vec_pretty(self).expect("snapshot metadata encodes as JSON")
    }

    /// Total size of the snapshot's files in bytes.
    pub fn size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Checks what a reader relies on beyond the types: file names are plain, unique file names,
    /// so that a download cannot write outside its staging folder.
    pub(crate) fn validate(&self) -> std::result::Result<(), MetadataProblem> {
        let mut seen = HashSet::new();
        for file in &self.files {
            let name = file.file_name()?;
            if !seen.insert(name) {
                return Err(MetadataProblem::DuplicateFile { name: name.into() });
            }
            if let Some(key) = &file.key {
                validate_object_key(key).map_err(|reason| MetadataProblem::BadObjectKey {
                    name: name.into(),
                    key: key.clone(),
                    reason,
                })?;
            }
        }
        Ok(())
    }
}

/// What makes a `metadata.json` unsafe to act on, although it decodes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataProblem {
    /// A file name with folders or `..` would make a download write outside its folder.
    #[error("file name {name:?} is not a plain file name")]
    NotPlainFileName { name: String },
    #[error("file {name} is listed twice")]
    DuplicateFile { name: String },
    #[error("file {name} has object key {key:?}: {reason}")]
    BadObjectKey {
        name: String,
        key: String,
        reason: &'static str,
    },
}

impl SnapshotFile {
    /// The file's name without RocksDB's leading slash (`000030.sst`), checked to be a plain file
    /// name: no folders, no `..`.
    pub fn file_name(&self) -> std::result::Result<&str, MetadataProblem> {
        let name = self.name.strip_prefix('/').unwrap_or(&self.name);
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && !name.contains(['/', '\\', '\0'])
            && name != "metadata.json";
        if plain {
            Ok(name)
        } else {
            Err(MetadataProblem::NotPlainFileName {
                name: self.name.clone(),
            })
        }
    }
}

/// An object key relative to a partition folder must stay inside it.
pub(crate) fn validate_object_key(key: &str) -> std::result::Result<(), &'static str> {
    if key.is_empty() || key.starts_with('/') || key.ends_with('/') {
        return Err("it must be a relative path");
    }
    if key
        .split('/')
        .any(|segment| segment.is_empty() || segment == "." || segment == "..")
    {
        return Err("it must not contain empty, `.` or `..` segments");
    }
    Ok(())
}

/// Checksum of a file's bytes: `xxh3-128:<32 lower-case hex digits>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Checksum {
    xxh3_128: u128,
}

impl Checksum {
    const ALGORITHM_PREFIX: &str = "xxh3-128:";

    pub fn from_xxh3_128(xxh3_128: u128) -> Checksum {
        Checksum { xxh3_128 }
    }

    pub fn xxh3_128(self) -> u128 {
        self.xxh3_128
    }

    /// The checksum as 32 hex digits; the repository names SST objects by it.
    pub fn hex(self) -> String {
        format!("{:032x}", self.xxh3_128)
    }
}

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:032x}", Self::ALGORITHM_PREFIX, self.xxh3_128)
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Why a text is not a [`Checksum`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChecksumParseError {
    #[error("checksum {text:?} is not xxh3-128, the only algorithm this build knows")]
    UnknownAlgorithm { text: String },
    #[error("checksum {text:?} needs 32 hex digits after `xxh3-128:`")]
    NotHex { text: String },
}

impl FromStr for Checksum {
    type Err = ChecksumParseError;

    fn from_str(text: &str) -> std::result::Result<Self, ChecksumParseError> {
        let hex = text
            .strip_prefix(Self::ALGORITHM_PREFIX)
            .ok_or_else(|| ChecksumParseError::UnknownAlgorithm { text: text.into() })?;
        let not_hex = || ChecksumParseError::NotHex { text: text.into() };
        if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(not_hex());
        }
        let xxh3_128 = u128::from_str_radix(hex, 16).map_err(|_| not_hex())?;
        Ok(Checksum { xxh3_128 })
    }
}

impl Serialize for Checksum {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// `SystemTime` as RFC 3339 with nanoseconds, the form of seed 000.
pub(crate) mod rfc3339 {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::SystemTime;

    pub fn serialize<S: Serializer>(time: &SystemTime, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_rfc3339_nanos(*time))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SystemTime, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_rfc3339_weak(&text)
            .map_err(|e| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 time: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seed 000's sample, with the `log_id` that Cairn adds.
    const SEED_SAMPLE: &str = r#"{
  "version": "V1",
  "cluster_name": "snap-test",
  "partition_id": 1,
  "node_name": "n1",
  "created_at": "2024-09-26T07:31:49.264522000Z",
  "snapshot_id": "snap_12PclG04SN8eVSKYXCFgXx7",
  "key_range": {
    "start": 9223372036854775808,
    "end": 18446744073709551615
  },
  "min_applied_lsn": 3,
  "db_comparator_name": "leveldb.BytewiseComparator",
  "log_id": 1,
  "files": [
    {
      "column_family_name": "",
      "name": "/000030.sst",
      "directory": "/Users/pavel/restate/test/n1/db-snapshots/1/snap_12PclG04SN8eVSKYXCFgXx7",
      "size": 1267,
      "level": 0,
      "start_key": "64650000000000000001010453454c46",
      "end_key": "667300000000000000010000000000000002",
      "smallest_seqno": 11,
      "largest_seqno": 12,
      "num_entries": 0,
      "num_deletions": 0
    },
    {
      "column_family_name": "",
      "name": "/000029.sst",
      "directory": "/Users/pavel/restate/test/n1/db-snapshots/1/snap_12PclG04SN8eVSKYXCFgXx7",
      "size": 1142,
      "level": 6,
      "start_key": "64650000000000000001010453454c46",
      "end_key": "667300000000000000010000000000000002",
      "smallest_seqno": 0,
      "largest_seqno": 0,
      "num_entries": 0,
      "num_deletions": 0
    }
  ]
}"#;

    #[test]
    fn the_seed_sample_parses_with_every_field() {
        let m = SnapshotMetadata::from_json(SEED_SAMPLE.as_bytes()).unwrap();
        assert_eq!(m.version, MetadataVersion::V1);
        assert_eq!(m.cluster_name, "snap-test");
        assert_eq!(m.partition_id, PartitionId(1));
        assert_eq!(m.node_name, "n1");
        assert_eq!(
            humantime::format_rfc3339_nanos(m.created_at).to_string(),
            "2024-09-26T07:31:49.264522000Z"
        );
        assert_eq!(m.snapshot_id.to_string(), "snap_12PclG04SN8eVSKYXCFgXx7");
        assert_eq!(
            m.key_range,
            KeyRange {
                start: 1 << 63,
                end: u64::MAX
            }
        );
        assert_eq!(m.min_applied_lsn, Lsn(3));
        assert_eq!(m.log_id, LogId(1));
        assert_eq!(m.db_comparator_name, "leveldb.BytewiseComparator");
        assert_eq!(m.files.len(), 2);
        assert_eq!(m.files[0].name, "/000030.sst");
        assert_eq!(m.files[0].file_name().unwrap(), "000030.sst");
        assert_eq!(m.files[1].level, 6);
        assert_eq!(m.files[0].start_key, "64650000000000000001010453454c46");
        assert_eq!(
            (m.files[0].smallest_seqno, m.files[0].largest_seqno),
            (11, 12)
        );
        assert_eq!(m.files[0].checksum, None);
        assert_eq!(m.size(), 1267 + 1142);
    }

    #[test]
    fn encoding_round_trips_and_keeps_the_seed_field_names() {
        let mut m = SnapshotMetadata::from_json(SEED_SAMPLE.as_bytes()).unwrap();
        m.files[0].checksum = Some(Checksum::from_xxh3_128(0xabc));
        m.files[0].key = Some("ssts/00000000000000000000000000000abc.sst".into());
        m.stats = Some(PublishStats {
            uploaded_files: 1,
            uploaded_bytes: 1267,
        });
        let json = m.to_json_pretty();
        assert_eq!(SnapshotMetadata::from_json(&json).unwrap(), m);
        let text = String::from_utf8(json).unwrap();
        assert!(text.contains("\"created_at\": \"2024-09-26T07:31:49.264522000Z\""));
        assert!(text.contains("\"checksum\": \"xxh3-128:00000000000000000000000000000abc\""));
        // Every field name of the seed sample is written as it was.
        let written: serde_json::Value = serde_json::from_str(&text).unwrap();
        let seed: serde_json::Value = serde_json::from_str(SEED_SAMPLE).unwrap();
        for (field, _) in seed.as_object().unwrap() {
            assert!(written.get(field).is_some(), "field {field} is missing");
        }
        for (field, _) in seed["files"][0].as_object().unwrap() {
            assert!(
                written["files"][0].get(field).is_some(),
                "file field {field}"
            );
        }
    }

    #[test]
    fn unknown_fields_are_tolerated() {
        let mut value: serde_json::Value = serde_json::from_str(SEED_SAMPLE).unwrap();
        value["added_by_a_newer_writer"] = serde_json::json!({"x": 1});
        value["files"][0]["also_new"] = serde_json::json!(true);
        let bytes = serde_json::to_vec(&value).unwrap();
        assert!(SnapshotMetadata::from_json(&bytes).is_ok());
    }

    #[test]
    fn an_unknown_version_is_refused_by_name() {
        let text = SEED_SAMPLE.replace("\"V1\"", "\"V2\"");
        let err = SnapshotMetadata::from_json(text.as_bytes()).unwrap_err();
        assert!(matches!(&err, Error::UnsupportedVersion { found, .. } if found == "V2"));
        let message = err.to_string();
        assert!(
            message.contains("V2") && message.contains("reads V1"),
            "{message}"
        );

        // Even when the rest of the document would not parse as V1.
        let err =
            SnapshotMetadata::from_json(br#"{"version":"V3","files":"elsewhere"}"#).unwrap_err();
        assert!(matches!(err, Error::UnsupportedVersion { .. }), "{err}");
    }

    #[test]
    fn malformed_documents_are_refused() {
        let cases: [(&str, String); 4] = [
            (
                "no version",
                SEED_SAMPLE.replace("\"version\": \"V1\",", ""),
            ),
            ("no log id", SEED_SAMPLE.replace("\"log_id\": 1,", "")),
            (
                "path in file name",
                SEED_SAMPLE.replace("/000030.sst", "/../../etc/passwd"),
            ),
            (
                "duplicate file",
                SEED_SAMPLE.replace("/000029.sst", "/000030.sst"),
            ),
        ];
        for (case, text) in cases {
            let err = SnapshotMetadata::from_json(text.as_bytes()).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::MalformedMetadata { .. } | Error::UndecodableMetadata { .. }
                ),
                "{case}: {err}"
            );
        }
    }

    #[test]
    fn checksums_parse_only_in_their_one_form() {
        let c: Checksum = "xxh3-128:0123456789abcdef0123456789abcdef".parse().unwrap();
        assert_eq!(c.to_string(), "xxh3-128:0123456789abcdef0123456789abcdef");
        assert!("sha256:00".parse::<Checksum>().is_err());
        assert!("xxh3-128:12".parse::<Checksum>().is_err());
        assert!(
            "xxh3-128:+123456789abcdef0123456789abcdef"
                .parse::<Checksum>()
                .is_err()
        );
    }
}
