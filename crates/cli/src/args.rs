//! Command-line arguments. The global options follow the admin tools our users already know.

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "cairnctl",
    version,
    about = "Administer a Cairn cluster",
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalOptions,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TableStyle {
    Compact,
    Borders,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TimeFormat {
    Human,
    Iso8601,
    Rfc2822,
}

#[derive(Debug, Args)]
pub struct GlobalOptions {
    /// Increase logging verbosity
    #[arg(short, long, action = ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Decrease logging verbosity
    #[arg(short, long, action = ArgAction::Count, global = true)]
    pub quiet: u8,
    /// Which table output style to use
    #[arg(long, value_enum, default_value = "compact", global = true)]
    pub table_style: TableStyle,
    #[arg(long, value_enum, default_value = "human", global = true)]
    pub time_format: TimeFormat,
    /// Auto answer "yes" to confirmation prompts
    #[arg(short = 'y', long, global = true)]
    pub yes: bool,
    /// Connection timeout for network calls, in milliseconds
    #[arg(long, default_value_t = 5000, global = true)]
    pub connect_timeout: u64,
    /// Timeout for a call's answer to start, in milliseconds. Snapshot create and export and
    /// partition restore answer at once and then stream progress for as long as they take
    #[arg(long, default_value_t = 13000, global = true)]
    pub request_timeout: u64,
    /// Node address host:port (e.g. http://localhost:5122/). Give several (repeated, or
    /// separated by commas) to use the first that answers: any node of a cluster answers for
    /// all of it
    #[arg(
        long,
        visible_alias = "cluster-controller",
        env = "CAIRNCTL_ADDRESS",
        default_value = "http://localhost:5122/",
        value_delimiter = ',',
        global = true
    )]
    pub address: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Read and write keys
    #[command(subcommand)]
    Kv(KvCommand),
    /// Partitions of the cluster
    #[command(subcommand)]
    Partitions(PartitionsCommand),
    /// The partitions' logs
    #[command(subcommand)]
    Logs(LogsCommand),
    /// Partition snapshots
    #[command(subcommand)]
    Snapshots(SnapshotsCommand),
    /// The cluster's nodes
    #[command(subcommand)]
    Nodes(NodesCommand),
    /// The cluster as a whole
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Show which node holds the controller's lease, the node timeout, and each node's state
    Status,
    /// Preview where every partition would run on the nodes named, balanced, moving as little as
    /// it can: each role that changes node, what a copy means in bytes, and how many partitions
    /// stay put. Changes nothing
    Plan {
        /// Every node of the cluster after the change, by name: add names to scale out, leave
        /// some out to scale in
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// How to print the plan
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
        /// Then have the current leaders publish a fresh snapshot of every partition that would
        /// be copied (little is uploaded where a recent one exists), so that the copies load
        /// recent data and replay little
        #[arg(long)]
        upload: bool,
    },
    /// Move partitions so that every one is placed, balanced, on the nodes named: shows the plan,
    /// asks to confirm, has the current leaders upload fresh snapshots of what will be copied,
    /// then has the controller move each partition (the new holders load it and catch up as
    /// followers, the leadership is handed over, the old holders drop it) and follows it to the
    /// end. Every step is recorded in the cluster: a controller that fails is replaced and goes
    /// on, and a move that cannot finish is reverted
    Scale {
        /// Every node of the cluster after the change, by name: add names to scale out, leave
        /// some out to scale in
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// Partitions moved at once
        #[arg(long, default_value_t = 2)]
        max_concurrent_moves: u32,
        /// Start the operation and return: `cairnctl cluster operations describe ID` follows it
        #[arg(long)]
        detach: bool,
        /// Skip the fresh snapshots before the moves: the new holders load the newest snapshot
        /// there is and replay the log past it
        #[arg(long)]
        no_upload: bool,
    },
    /// Scaling operations: the one under way and the last ones finished
    #[command(subcommand)]
    Operations(OperationsCommand),
}

#[derive(Debug, Subcommand)]
pub enum OperationsCommand {
    /// Every operation recorded, oldest first
    List {
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// One operation, move by move
    Describe {
        id: u64,
        #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
    },
    /// Stop a running operation: moves not cut over yet are reverted, those cut over finish
    Cancel { id: u64 },
}

/// How a command prints what it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    /// One JSON document (sizes in bytes), for scripts
    Json,
}

#[derive(Debug, Subcommand)]
pub enum SnapshotsCommand {
    /// Create
    #[command(name = "create-snapshot", visible_alias = "create")]
    Create {
        /// Partitions to snapshot, e.g. `-p 3,7,9`; every partition when omitted
        #[arg(
            short = 'p',
            long = "partition-id",
            value_delimiter = ',',
            conflicts_with = "node"
        )]
        partition_id: Vec<u32>,
        /// Every partition this node leads
        #[arg(long)]
        node: Option<String>,
        /// Upload every file anew instead of reusing the repository's copies, and always make a
        /// new snapshot (a full sync, for a repository no longer trusted)
        #[arg(long)]
        full: bool,
        /// Return an existing snapshot if it covers this LSN; otherwise cover at least it
        #[arg(long)]
        min_lsn: Option<u64>,
        /// Trim the partition's log up to the snapshot's LSN once it is published and read
        /// back whole (older retained snapshots then cannot be replayed forward: restores use
        /// this one or newer)
        #[arg(long)]
        trim_log: bool,
    },
    /// List snapshots in the repository, newest first
    List {
        /// Only this partition's snapshots
        #[arg(short = 'p', long = "partition-id")]
        partition_id: Option<u32>,
    },
    /// Print a snapshot's metadata.json
    Describe { snapshot_id: String },
    /// Write a snapshot (metadata.json and its SST files) to a tar file
    Export {
        snapshot_id: String,
        /// The tar file to write
        #[arg(short = 'o', long)]
        output: std::path::PathBuf,
    },
    /// Download every file of a snapshot and check its size and checksum
    Verify { snapshot_id: String },
}

#[derive(Debug, Subcommand)]
pub enum KvCommand {
    /// Store a value under a key
    Put {
        key: String,
        value: String,
        /// Time to live, e.g. `30s`, `10m`, `1h`
        #[arg(long, value_parser = parse_ttl)]
        ttl: Option<Duration>,
    },
    /// Print the values of keys
    Get {
        #[arg(required = true)]
        keys: Vec<String>,
        #[command(flatten)]
        freshness: Freshness,
    },
    /// Delete keys
    Delete {
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Tell which keys exist
    Exists {
        #[arg(required = true)]
        keys: Vec<String>,
        #[command(flatten)]
        freshness: Freshness,
    },
    /// Insert keys that are absent, and tell which ones this call inserted
    InsertIfAbsent {
        #[arg(required = true)]
        keys: Vec<String>,
        /// Value stored under every inserted key
        #[arg(long, default_value = "")]
        value: String,
        /// Time to live, e.g. `30s`, `10m`, `1h`
        #[arg(long, value_parser = parse_ttl)]
        ttl: Option<Duration>,
    },
}

/// A TTL in human units that the protocol can carry (64-bit milliseconds).
/// How fresh a read must be.
#[derive(Debug, Args)]
pub struct Freshness {
    /// Accept values up to this old (e.g. 500ms, 2s), answered by the node's own replica of
    /// each key when it has one, even a follower, instead of forwarding the key to its leader
    /// (within the bound, also while the leader is unreachable). A write acknowledged within
    /// that time may be missing, and a later read may show an older value. With 0s the answer
    /// holds every write acknowledged before it (the follower asks its leader how far to apply
    /// the log first), but it is still not linearizable: it may show a write not yet
    /// acknowledged that the leader does not show yet. Default: linearizable
    #[arg(long, value_parser = parse_staleness)]
    pub max_staleness: Option<Duration>,
}

fn parse_staleness(text: &str) -> anyhow::Result<Duration> {
    let max = humantime::parse_duration(text).map_err(|e| {
        anyhow::anyhow!("{text:?} is not a duration ({e}); write it like 0s, 500ms or 2s")
    })?;
    if u64::try_from(max.as_millis()).is_err() {
        anyhow::bail!("{text} is out of range: it must fit in 64-bit milliseconds");
    }
    Ok(max)
}

fn parse_ttl(text: &str) -> anyhow::Result<Duration> {
    let ttl = humantime::parse_duration(text).map_err(|e| {
        anyhow::anyhow!("{text:?} is not a duration ({e}); write it like 30s, 10m or 1h")
    })?;
    // Sent as 0 it would be refused as "ttl_ms is 0", which is not what the operator typed.
    if ttl < Duration::from_millis(1) && !ttl.is_zero() {
        anyhow::bail!("{text} is shorter than 1 millisecond, the unit of TTLs; give at least 1ms");
    }
    if u64::try_from(ttl.as_millis()).is_err() {
        anyhow::bail!(
            "{text} is out of range: a TTL must fit in 64-bit milliseconds; give a shorter one (nodes accept up to 10 years)"
        );
    }
    Ok(ttl)
}

#[derive(Debug, Subcommand)]
pub enum NodesCommand {
    /// List every node that joined the cluster: its address, whether it is alive, when it was
    /// last heard from, and how many partitions it leads and follows
    List,
    /// Remove a stopped node that leads and follows nothing from the cluster for good (a node
    /// started again under its name joins anew)
    Remove { node: String },
}

#[derive(Debug, Subcommand)]
pub enum PartitionsCommand {
    /// List partitions with their key range, leader, epoch and LSNs
    List,
    /// Show a partition with its store's size, its time and how much of it has expired
    Describe {
        #[arg(short = 'p', long = "partition-id")]
        partition_id: u32,
    },
    /// Compact partition stores now, reclaiming the space of expired values (all partitions by
    /// default; compactions do it by themselves over time)
    Compact {
        /// Only this partition
        #[arg(short = 'p', long = "partition-id")]
        partition_id: Option<u32>,
    },
    /// Rebuild a partition's store from a snapshot, then replay its log
    Restore {
        #[arg(short = 'p', long = "partition-id")]
        partition_id: u32,
        /// A retained snapshot of the partition; the newest suitable one when omitted
        #[arg(long)]
        snapshot: Option<String>,
    },
    /// Make a node follow partitions beside their leaders and followers: it loads each from the
    /// newest snapshot (when its store is empty or behind the log's trim point), then tails the
    /// log. Shows progress until each has applied the log as it stood when asked
    Load {
        /// The partitions, e.g. `-p 3,7`
        #[arg(
            short = 'p',
            long = "partition-id",
            value_delimiter = ',',
            required = true
        )]
        partition_id: Vec<u32>,
        /// The node to load them on
        #[arg(long)]
        node: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum LogsCommand {
    /// Show the trim point and tail of logs
    Describe {
        /// Only this log
        #[arg(short = 'l', long = "log-id")]
        log_id: Option<u32>,
    },
    /// Trim a log up to and including an LSN
    Trim {
        #[arg(short = 'l', long = "log-id")]
        log_id: u32,
        /// Trim point: every record up to this LSN is removed
        #[arg(short = 't', long = "trim-point")]
        trim_point: u64,
        /// Trim past the archived LSN, losing records that no snapshot covers
        #[arg(long)]
        force: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn snapshot_commands_parse_as_in_the_seed() {
        let create = |args: &[&str]| match Cli::try_parse_from(
            ["cairnctl", "snapshots"].iter().chain(args).copied(),
        ) {
            Ok(Cli {
                command: Command::Snapshots(create @ SnapshotsCommand::Create { .. }),
                ..
            }) => Ok(create),
            Ok(other) => panic!("{other:?}"),
            Err(err) => Err(err.to_string()),
        };
        let SnapshotsCommand::Create {
            partition_id,
            min_lsn,
            trim_log,
            node,
            full,
        } = create(&["create", "-p", "1"]).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(
            (partition_id, min_lsn, trim_log, node, full),
            (vec![1], None, false, None, false)
        );
        let SnapshotsCommand::Create {
            partition_id,
            min_lsn,
            ..
        } = create(&["create-snapshot", "--min-lsn", "7"]).unwrap()
        else {
            unreachable!()
        };
        assert_eq!((partition_id, min_lsn), (vec![], Some(7)));
        // A chosen set, a node's partitions (seed 003's node-level CreateSnapshots), a full sync.
        let SnapshotsCommand::Create { partition_id, .. } =
            create(&["create", "-p", "3,7,9"]).unwrap()
        else {
            unreachable!()
        };
        assert_eq!(partition_id, vec![3, 7, 9]);
        let SnapshotsCommand::Create { node, full, .. } =
            create(&["create", "--node", "n2", "--full"]).unwrap()
        else {
            unreachable!()
        };
        assert_eq!((node.as_deref(), full), (Some("n2"), true));
        let err = create(&["create", "-p", "3", "--node", "n2"]).unwrap_err();
        assert!(err.contains("cannot be used with"), "{err}");
    }

    #[test]
    fn ttls_the_protocol_cannot_carry_are_refused() {
        // 2^64 ms + 384 ms: it used to wrap to a TTL of 384 ms.
        let err = Cli::try_parse_from([
            "cairnctl",
            "kv",
            "put",
            "k",
            "v",
            "--ttl",
            "18446744073709552s",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("out of range"), "{err}");
        let cli = Cli::try_parse_from(["cairnctl", "kv", "put", "k", "v", "--ttl", "10m"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Kv(KvCommand::Put { ttl: Some(ttl), .. }) if ttl == Duration::from_secs(600)
        ));
    }

    #[test]
    fn seed_style_invocations_parse() {
        let cli =
            Cli::try_parse_from(["cairnctl", "logs", "trim", "-l", "0", "-t", "1000"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Logs(LogsCommand::Trim {
                log_id: 0,
                trim_point: 1000,
                force: false
            })
        ));
        let cli = Cli::try_parse_from([
            "cairnctl",
            "--table-style",
            "borders",
            "-y",
            "--cluster-controller",
            "http://localhost:9/",
            "partitions",
            "list",
        ])
        .unwrap();
        assert_eq!(cli.global.table_style, TableStyle::Borders);
        assert_eq!(cli.global.address, vec!["http://localhost:9/".to_string()]);
        assert!(cli.global.yes);
    }
}
