//! The RocksDB databases of a node's partitions and the per-partition handles on them.

use crate::expiry::{Expiry, ExpiryFilterFactory};
use crate::keys::{self, FSM_APPLIED_LSN, FSM_LEADER, FSM_PARTITION_TIME};
use crate::{Error, Result};
use bytes::Bytes;
use cairn_types::{Epoch, Lsn, NodeId, PartitionId};
use rust_rocksdb::{
    BlockBasedOptions, BoundColumnFamily, ColumnFamilyDescriptor, DB, DBCompactionStyle,
    DBCompressionType, Options, WriteBatch, WriteOptions,
};
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Table options. The defaults write SST files that Debian 12's RocksDB 7.8 tools can read.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Block-based table `format_version`. RocksDB 7.8 reads up to 5.
    pub format_version: i32,
    /// Shared block cache for all partitions, in bytes.
    pub block_cache_bytes: usize,
    /// How much of a partition's newest writes its store holds in memory before it writes them
    /// out as one level-0 file, in bytes. They fill [`MEMTABLES_PER_FLUSH`] memtables of that
    /// fraction of it each, which are flushed together; up to twice this much is in memory while
    /// a flush runs.
    pub write_buffer_bytes: usize,
    /// What the memtables of every partition may hold in all, in bytes; 0: no bound beyond each
    /// partition's own. Past seven eighths of it, a partition that writes flushes its memtables
    /// early (into a smaller file), so a node of many partitions holds at most about this much
    /// of their newest writes in memory, not `2 × write_buffer_bytes` for each of them.
    pub write_buffer_budget_bytes: usize,
    /// How a partition's tables are merged as they accumulate.
    pub compaction_style: CompactionStyle,
    /// The size of a table's data blocks before compression, in bytes: the unit RocksDB
    /// compresses, checksums, indexes and caches. Tables keep the size they were written with;
    /// a change applies to those written after it.
    ///
    /// 16 KiB, not RocksDB's 4 KiB: flushes and merges compress, checksum, index and write out
    /// each block by itself, and LZ4 shrinks a larger block further. Measured on two cores with
    /// 16 partitions and 100-byte values of one repeated byte (`cairn-bench --seconds 10
    /// --rounds 5 --workloads put-batch,insert-batch --front-ends grpc,resp`, two runs of 16 KiB
    /// against three of 4 KiB): 3.9 against 4.2-4.4 CPU µs per key over all the rounds' batched
    /// writes, 7-10% more keys/s, and tables about a tenth smaller per key; with values of
    /// random bytes (`--random-values`, one run each), 4.9 against 5.3 µs per key and 6% more
    /// keys/s. Gets of 10,000 keys came out even; of 3 million keys, more than the block cache
    /// holds, 16 KiB served 1.5-1.8 times the keys/s of 4 KiB, and 32 KiB less than 16 KiB.
    pub block_bytes: usize,
}

/// How a partition's tables are merged as they accumulate. A store written under one opens under
/// the other: both keep each level as one sorted run of tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompactionStyle {
    /// RocksDB's universal compaction: sorted runs of about the same size are merged into one,
    /// so a key is rewritten about once each time the data it sits in doubles. Keys reach a
    /// partition in hash order, each flushed table spans the partition's whole key range, and
    /// leveled compaction rewrites the partition's whole last level with every batch of level-0
    /// tables while it holds less than a level's worth (256 MiB). Measured on two cores with
    /// 16 partitions (`cairn-bench --seconds 10 --rounds 5 --front-ends grpc`, two runs of each
    /// style): in the last two rounds, with about 1 GiB of tables in the node, the batched put
    /// ran at 380k-580k keys/s (3.1-4.7 CPU µs per key) against 280k-320k (6.0-6.9) leveled.
    /// The cost: a merge that takes in the oldest run rewrites the whole partition and needs as
    /// much free disk again for that partition while it runs, and a lookup checks a bloom filter
    /// per sorted run.
    #[default]
    Universal,
    /// RocksDB's leveled compaction (with levels sized from the last one): less disk held during
    /// a compaction, more rewriting under steady writes of keys in hash order.
    Leveled,
}

/// The memtables a partition fills before they are flushed together into one level-0 file.
///
/// Keys reach a memtable in hash order, so an insert searches the memtable's skip list down from
/// its top, a cache miss per level once the memtables being written outgrow the CPU's caches: with
/// 16 partitions and 8 MiB memtables that is 128 MiB. Sixteen memtables of 512 KiB per 8 MiB
/// flushed keep what inserts search to a sixteenth of that (8 MiB, near the two cores' 4 MiB of
/// L2), and the files, their number and the compactions after them stay as they were. Measured on
/// two cores with 16 partitions (`cairn-bench`, 100 keys per request): eight memtables of 1 MiB
/// gave about 1.4 times the batched put and insert-if-absent of one 8 MiB memtable, and batched
/// gets about 12% less, as a lookup checks a bloom filter per memtable; sixteen gave another 13%
/// of batched put over 6 s (3.6% over 100 s, where compactions take more of the CPU), with
/// insert-if-absent and gets even. Thirty-two made gets slower again.
pub const MEMTABLES_PER_FLUSH: usize = 16;

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            format_version: 5,
            block_cache_bytes: 256 * 1024 * 1024,
            // Small, as what inserts search must stay in the CPU's caches (see
            // `MEMTABLES_PER_FLUSH`). With 16 partitions and one memtable per flush, RocksDB's
            // 64 MiB default gave two-thirds of the batched put throughput of 8 MiB over a minute
            // of writing.
            write_buffer_bytes: 8 * 1024 * 1024,
            // Above what 16 partitions hold at most (256 MiB), so a node of a few dozen flushes
            // as it did without one; a node of 1,024 holds 1 GiB instead of up to 16 GiB.
            write_buffer_budget_bytes: 1024 * 1024 * 1024,
            compaction_style: CompactionStyle::default(),
            block_bytes: 16 * 1024,
        }
    }
}

/// A value as stored, with its expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredValue {
    pub value: Bytes,
    /// Milliseconds since the Unix epoch after which the value is gone; `None` = never.
    pub expires_at_ms: Option<u64>,
}

impl StoredValue {
    /// Whether the value is still there at `now_ms`.
    pub fn is_live_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|at| now_ms < at)
    }
}

/// The leader a partition last accepted, as recorded by its processor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderState {
    pub epoch: Epoch,
    pub node: NodeId,
}

/// The partition stores of one node: a RocksDB per partition, each in a folder of its own under
/// the store's folder (`partition-<pid>.<generation>`), holding the partition's column family
/// (`data-<pid>`).
///
/// A database of its own keeps one partition's trouble its own: RocksDB stops a whole database
/// on a background error (a damaged block met by a compaction, a flush that failed), and with
/// one database for all of them that stopped every partition until a restart. It also gives each
/// partition a write queue of its own.
///
/// A store written before partitions had a database each (one RocksDB in the store's folder
/// itself, with a column family per partition) is opened as it is, and its partitions are
/// served from it until they are dropped; a restore imports a partition into a database of its
/// own.
pub struct PartitionStoreManager {
    path: PathBuf,
    options: StoreOptions,
    /// The one block cache of every partition's tables, `options.block_cache_bytes` in all.
    block_cache: rust_rocksdb::Cache,
    /// The one account of every partition's memtables, `options.write_buffer_budget_bytes`.
    write_buffers: rust_rocksdb::WriteBufferManager,
    /// Each partition's own database, opened or not.
    own: Mutex<HashMap<PartitionId, OwnDb>>,
    /// The database that held every partition before they had one each, if this store has one.
    shared: Option<Arc<DB>>,
    /// Creating, importing and dropping a partition's store, one at a time.
    changing: Mutex<()>,
    /// The generation of the next partition folder created; above every one found at open, so
    /// a new database never shares a folder with a dropped one still open somewhere.
    next_generation: AtomicU64,
    /// Each partition's compaction filter state, created with its column family's options.
    expiries: Mutex<HashMap<PartitionId, Arc<Expiry>>>,
}

/// A partition's own database and its folder.
struct OwnDb {
    /// The database, or why it could not be opened (a file of it damaged or missing): such a
    /// partition has a store, which nothing uses until it is dropped.
    db: std::result::Result<Arc<DB>, Arc<Error>>,
    dir: PathBuf,
}

/// What the open finds in a partition's folder.
enum Found {
    /// None of the partition's data: a creation or a drop that a crash cut short, and why.
    Leftover(&'static str),
    /// A store: its column families, or why they cannot be listed.
    Store(Result<Vec<String>>),
}

pub(crate) fn cf_name(id: PartitionId) -> String {
    format!("data-{id}")
}

fn partition_of_cf(name: &str) -> Option<PartitionId> {
    name.strip_prefix("data-")?.parse().ok().map(PartitionId)
}

/// The folder of a partition's own database.
const DIR_PREFIX: &str = "partition-";
/// What a dropped partition's folder is renamed to before it is deleted, so that a crash in the
/// middle of the deletion leaves nothing that looks like a store.
const DROPPED_SUFFIX: &str = ".dropped";
/// A file in a partition's folder that says it is being dropped: written before anything of the
/// database is changed, so that the next open finishes a drop that a crash cut short.
const DROPPING: &str = "DROPPING";

/// The partition and generation of a partition folder's name (`partition-3.12`), written as this
/// store writes them: `partition-03.12` is not one.
fn parse_dir_name(name: &str) -> Option<(PartitionId, u64)> {
    let (id, generation) = name.strip_prefix(DIR_PREFIX)?.split_once('.')?;
    let (parsed_id, parsed_generation) = (id.parse::<u16>().ok()?, generation.parse::<u64>().ok()?);
    (parsed_id.to_string() == id && parsed_generation.to_string() == generation)
        .then_some((PartitionId(parsed_id), parsed_generation))
}

/// Options of every database of the store.
fn db_options() -> Options {
    let mut db_options = Options::default();
    // Only a new partition's database is created (`create_own`): RocksDB asked to open a folder
    // that lost its `CURRENT` would otherwise make a new, empty database there and delete the
    // tables it does not know.
    db_options.create_if_missing(false);
    db_options.create_missing_column_families(true);
    // Recover every complete write the WAL holds; a torn last write is dropped, which is safe
    // because the log will replay it.
    db_options.set_wal_recovery_mode(rust_rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords);
    // The background threads are the process's: every database shares these two (and one for
    // flushes).
    db_options.increase_parallelism(2);
    // A partition's processor is its database's one writer. In the shared database of an older
    // store, batches of several partitions that meet are inserted one after the other by one
    // thread: inserted concurrently, each insert would search its memtable's skip list from the
    // top; one after the other, it starts from where the previous insert into that memtable
    // ended. On two cores that was worth more than the parallelism.
    db_options.set_allow_concurrent_memtable_write(false);
    // Each start begins a new info log; keep a few per database rather than RocksDB's 1000.
    db_options.set_keep_log_file_num(5);
    // RocksDB reserves 4 MiB for each database's description by default; a partition's is a few
    // KiB (rewritten at every start), and 256 partitions would take 1 GiB of disk for nothing.
    db_options.set_manifest_preallocation_size(64 * 1024);
    db_options
}

/// `options` with every partition's memtables counted against one budget.
fn sharing(mut options: Options, write_buffers: &rust_rocksdb::WriteBufferManager) -> Options {
    options.set_write_buffer_manager(write_buffers);
    options
}

fn rocks(context: &'static str) -> impl FnOnce(rust_rocksdb::Error) -> Error {
    move |source| Error::RocksDb { context, source }
}

/// A file-system error, naming the file or folder it is about.
fn io_at(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.display().to_string();
    move |source| Error::Io {
        context,
        source: std::io::Error::new(source.kind(), format!("{path}: {source}")),
    }
}

/// Makes a rename or a removal in `dir` durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

impl PartitionStoreManager {
    pub fn open(path: &Path, options: &StoreOptions) -> Result<Self> {
        let open_err = |path: &Path| {
            let path = path.display().to_string();
            move |source| Error::Open { path, source }
        };
        std::fs::create_dir_all(path)
            .map_err(io_at("create the partition store's folder", path))?;
        let block_cache = rust_rocksdb::Cache::new_lru_cache(options.block_cache_bytes);
        // Flushes, not stalls, keep the memtables within the budget: a stalled write would hold
        // an apply thread that other partitions' processors share.
        let write_buffers = rust_rocksdb::WriteBufferManager::new_write_buffer_manager(
            options.write_buffer_budget_bytes,
            false,
        );
        let open_options = || sharing(db_options(), &write_buffers);
        let mut expiries = HashMap::new();
        let mut descriptors_of = |names: Vec<String>| -> Vec<ColumnFamilyDescriptor> {
            names
                .iter()
                .filter(|name| name.as_str() != "default")
                .map(|name| {
                    let expiry = Arc::new(Expiry::default());
                    if let Some(id) = partition_of_cf(name) {
                        expiries.insert(id, expiry.clone());
                    }
                    ColumnFamilyDescriptor::new(
                        name,
                        column_family_options(options, &block_cache, expiry),
                    )
                })
                .collect()
        };

        let shared = if path.join("CURRENT").exists() {
            let names = DB::list_cf(&db_options(), path).map_err(open_err(path))?;
            let db = DB::open_cf_descriptors(&open_options(), path, descriptors_of(names))
                .map_err(open_err(path))?;
            Some(Arc::new(db))
        } else {
            None
        };

        let mut found: HashMap<PartitionId, (PathBuf, Result<Vec<String>>)> = HashMap::new();
        let mut next_generation = 0;
        // Listed whole first: the loop renames and removes folders.
        let entries = std::fs::read_dir(path)
            .and_then(|entries| entries.collect::<std::io::Result<Vec<_>>>())
            .map_err(io_at("list the partition store's folder", path))?;
        for entry in entries {
            let name = entry.file_name().to_string_lossy().into_owned();
            let entry_path = entry.path();
            let kind = entry
                .file_type()
                .map_err(io_at("read the partition store's folder", &entry_path))?;
            if let Some(dropped) = name.strip_suffix(DROPPED_SUFFIX)
                && let Some((_, generation)) = parse_dir_name(dropped)
            {
                next_generation = next_generation.max(generation + 1);
                // A drop that a crash interrupted: finish it (a link goes, not what it names).
                if kind.is_dir() {
                    std::fs::remove_dir_all(&entry_path)
                } else {
                    std::fs::remove_file(&entry_path)
                }
                .map_err(io_at("remove a dropped partition store", &entry_path))?;
                continue;
            }
            let Some((id, generation)) = parse_dir_name(&name) else {
                continue;
            };
            next_generation = next_generation.max(generation + 1);
            if !kind.is_dir() {
                tracing::warn!(path = %entry_path.display(), "not a folder: passed over, though its name is that of a partition store");
                continue;
            }
            let listed = match survey(&entry_path, id) {
                Found::Leftover(why) => {
                    tracing::warn!(
                        partition = %id,
                        path = %entry_path.display(),
                        "removing a partition store's folder that holds none of its data: {why}"
                    );
                    remove_dropped(path, &entry_path)?;
                    continue;
                }
                Found::Store(listed) => listed,
            };
            if let Some((other, _)) = found.insert(id, (entry_path.clone(), listed)) {
                return Err(Error::TwoStores {
                    partition: id,
                    first: other.display().to_string(),
                    second: entry_path.display().to_string(),
                });
            }
        }
        let mut own = HashMap::new();
        for (id, (dir, listed)) in found {
            let opened = listed.and_then(|names| {
                DB::open_cf_descriptors(&open_options(), &dir, descriptors_of(names))
                    .map_err(open_err(&dir))
            });
            let db = match opened {
                Ok(db) => Ok(Arc::new(db)),
                // A damaged database keeps its partition down, not the node. Anything else (a
                // full disk, too many open files) is the node's to fix, and stops it here.
                Err(err) if err.is_damaged() => {
                    tracing::error!(partition = %id, "cannot open the partition's store: {err}");
                    Err(Arc::new(err))
                }
                Err(err) => return Err(err),
            };
            own.insert(id, OwnDb { db, dir });
        }
        Ok(PartitionStoreManager {
            path: path.to_path_buf(),
            options: options.clone(),
            block_cache,
            write_buffers,
            own: Mutex::new(own),
            shared,
            changing: Mutex::new(()),
            next_generation: AtomicU64::new(next_generation),
            expiries: Mutex::new(expiries),
        })
    }

    /// Options for a new column family of partition `id`, with a fresh compaction filter state
    /// that [`partition`](Self::partition) hands out from then on.
    fn new_cf_options(&self, id: PartitionId) -> Options {
        let expiry = Arc::new(Expiry::default());
        lock(&self.expiries).insert(id, expiry.clone());
        column_family_options(&self.options, &self.block_cache, expiry)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder holding partition `id`'s files: its database's, or the store's own for a
    /// partition in the shared database of an older store.
    pub fn partition_dir(&self, id: PartitionId) -> Option<PathBuf> {
        if let Some(own) = lock(&self.own).get(&id) {
            return Some(own.dir.clone());
        }
        self.db_of(id).map(|_| self.path.clone())
    }

    /// Why partition `id`'s store could not be opened, if it could not. Such a partition has a
    /// store, but [`partition`](Self::partition) gives none; [`drop_partition`]
    /// (Self::drop_partition) removes it.
    pub fn unopened(&self, id: PartitionId) -> Option<Arc<Error>> {
        lock(&self.own).get(&id)?.db.as_ref().err().cloned()
    }

    /// Whether partition `id` has a store here, opened or not.
    pub fn has_store(&self, id: PartitionId) -> bool {
        lock(&self.own).contains_key(&id) || self.db_of(id).is_some()
    }

    /// The database holding partition `id`'s column family: its own, or the shared one of an
    /// older store.
    fn db_of(&self, id: PartitionId) -> Option<Arc<DB>> {
        if let Some(own) = lock(&self.own).get(&id) {
            return own.db.as_ref().ok().cloned();
        }
        let shared = self.shared.as_ref()?;
        shared.cf_handle(&cf_name(id))?;
        Some(shared.clone())
    }

    /// The store of partition `id`, if this node has one.
    pub fn partition(&self, id: PartitionId) -> Option<PartitionStore> {
        let db = self.db_of(id)?;
        let expiry = lock(&self.expiries).entry(id).or_default().clone();
        Some(PartitionStore {
            db,
            id,
            cf_name: cf_name(id),
            expiry,
        })
    }

    /// Creates a database of its own for partition `id` in a new folder and runs `fill` on it;
    /// if `fill` fails, the database and its folder are removed again.
    fn create_own(
        &self,
        id: PartitionId,
        fill: impl FnOnce(&DB) -> Result<()>,
    ) -> Result<PartitionStore> {
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let dir = self.path.join(format!("{DIR_PREFIX}{id}.{generation}"));
        let mut options = sharing(db_options(), &self.write_buffers);
        options.create_if_missing(true);
        let created = DB::open(&options, &dir)
            .map_err(|source| Error::Open {
                path: dir.display().to_string(),
                source,
            })
            .and_then(|db| fill(&db).map(|()| db));
        let db = match created {
            Ok(db) => db,
            Err(err) => {
                // A full disk, say, or files RocksDB refused: nothing of it is worth keeping.
                if dir.exists()
                    && let Err(error) = remove_dropped(&self.path, &dir)
                {
                    tracing::warn!(path = %dir.display(), %error, "remove a partition store that could not be created");
                }
                return Err(err);
            }
        };
        let _ = sync_dir(&self.path);
        lock(&self.own).insert(
            id,
            OwnDb {
                db: Ok(Arc::new(db)),
                dir,
            },
        );
        self.partition(id).ok_or(Error::UnknownPartition(id))
    }

    /// The store of partition `id`, created empty if this node has none.
    pub fn open_or_create_partition(&self, id: PartitionId) -> Result<PartitionStore> {
        let _changing = lock(&self.changing);
        if let Some(store) = self.partition(id) {
            return Ok(store);
        }
        if let Some(source) = self.unopened(id) {
            return Err(Error::NotOpened {
                partition: id,
                source,
            });
        }
        let options = self.new_cf_options(id);
        self.create_own(id, |db| {
            db.create_cf(cf_name(id), &options)
                .map_err(rocks("create column family"))
        })
    }

    /// Creates partition `id`'s store from SST files that an [`PartitionStore::export`] made
    /// (possibly on another node), found in `dir` under their names. The files are moved into the
    /// store (hard links where the file system allows), so `dir` must be on the same file system
    /// as the store for this to be cheap. Fails if the partition already has a store.
    ///
    /// RocksDB creates the column family and then adds the files: a crash in between can leave
    /// an empty or partial store, so callers mark an import in progress durably and drop the
    /// partition on the next start if the mark is still there.
    pub fn import_partition(
        &self,
        id: PartitionId,
        dir: &Path,
        comparator_name: &str,
        files: &[ExportedFile],
    ) -> Result<PartitionStore> {
        let _changing = lock(&self.changing);
        if self.has_store(id) {
            return Err(Error::AlreadyExists(id));
        }
        let mut metadata = rust_rocksdb::ExportImportFilesMetaData::default();
        metadata.set_db_comparator_name(comparator_name);
        let directory = dir.display().to_string();
        let live_files: Vec<rust_rocksdb::LiveFile> = files
            .iter()
            .map(|f| f.to_live_file(cf_name(id), directory.clone()))
            .collect();
        metadata
            .set_files(&live_files)
            .map_err(rocks("describe files to import"))?;
        let mut import_options = rust_rocksdb::ImportColumnFamilyOptions::default();
        import_options.set_move_files(true);
        let options = self.new_cf_options(id);
        self.create_own(id, |db| {
            db.create_column_family_with_import(&options, cf_name(id), &import_options, &metadata)
                .map_err(rocks("import column family"))
        })
    }

    /// Drops partition `id`'s store and everything in it. Its own database is closed to new
    /// background work and its folder deleted; handles still held elsewhere fail from then on.
    pub fn drop_partition(&self, id: PartitionId) -> Result<()> {
        let _changing = lock(&self.changing);
        let own = lock(&self.own).remove(&id);
        let in_shared = self
            .shared
            .as_ref()
            .filter(|shared| shared.cf_handle(&cf_name(id)).is_some());
        if own.is_none() && in_shared.is_none() {
            return Err(Error::UnknownPartition(id));
        }
        if let Some(OwnDb { db: Err(_), dir }) = &own {
            remove_dropped(&self.path, dir)?;
        }
        if let Some(OwnDb { db: Ok(db), dir }) = own {
            // The intent first, durably: from here on a crash leaves a folder that the next open
            // deletes. Then the column family is dropped before background work stops, so that
            // nothing of it is flushed (RocksDB flushes what it holds in memory when it stops);
            // a database that RocksDB stopped may refuse the drop, and goes all the same.
            let mark = dir.join(DROPPING);
            std::fs::File::create(&mark)
                .and_then(|file| file.sync_all())
                .and_then(|()| sync_dir(&dir))
                .map_err(io_at("mark a partition store as being dropped", &mark))?;
            if let Err(error) = db.drop_cf(&cf_name(id)) {
                tracing::warn!(partition = %id, %error, "drop the column family of a partition store being removed");
            }
            db.cancel_all_background_work(true);
            drop(db);
            remove_dropped(&self.path, &dir)?;
        }
        if let Some(shared) = in_shared {
            shared
                .drop_cf(&cf_name(id))
                .map_err(rocks("drop column family"))?;
        }
        Ok(())
    }

    /// Every database of the store.
    fn databases(&self) -> Vec<Arc<DB>> {
        let mut all: Vec<Arc<DB>> = lock(&self.own)
            .values()
            .filter_map(|own| own.db.as_ref().ok().cloned())
            .collect();
        all.extend(self.shared.clone());
        all
    }

    /// Waits until no flush or compaction is running or queued in any partition. Writers must
    /// pause for it to return.
    pub fn wait_for_background_work(&self) -> Result<()> {
        for db in self.databases() {
            db.wait_for_compact(&rust_rocksdb::WaitForCompactOptions::default())
                .map_err(rocks("wait for compactions"))?;
        }
        Ok(())
    }

    /// Whether a restore of partition `id` can replace its store. A partition with a database
    /// of its own always can: the restore drops that database whole, even one RocksDB stopped.
    /// A partition in the shared database of an older store cannot once RocksDB stopped that
    /// database (a damaged table met by a compaction, a failed flush): it refuses the column
    /// family's drop and every import. Checked by writing a deletion of a key no partition holds,
    /// in its default column family.
    pub fn check_writable(&self, id: PartitionId) -> Result<()> {
        if lock(&self.own).contains_key(&id) {
            return Ok(());
        }
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        let mut options = WriteOptions::default();
        options.disable_wal(true);
        let mut batch = WriteBatch::default();
        batch.delete(b"writable");
        shared.write_opt(&batch, &options).map_err(rocks("write"))
    }

    /// Partitions that have a store here (opened or not), in id order.
    pub fn partitions(&self) -> Vec<PartitionId> {
        let mut ids: Vec<PartitionId> = lock(&self.own).keys().copied().collect();
        if self.shared.is_some() {
            ids.extend(
                DB::list_cf(&Options::default(), &self.path)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|name| partition_of_cf(name))
                    .filter(|id| self.db_of(*id).is_some()),
            );
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

/// What partition `id`'s folder holds, without opening its database. A drop marks the folder
/// before it changes anything, so a marked folder is a drop a crash cut short. RocksDB writes
/// `CURRENT` last when it creates a database, before any table or later description; the
/// partition's column family comes after that, and its tables after the column family. So a
/// folder with no table file and either no `CURRENT` (nor any description but the first) or no
/// column family of the partition is a creation cut short. Anything else is a store, damaged if it
/// cannot be opened, which the open reports and nothing deletes: a folder that lost its `CURRENT`
/// or its description but holds tables, a description cut short (RocksDB then lists the column
/// families it got to, and opening it would delete the tables it no longer lists), a store under
/// another partition's name.
fn survey(dir: &Path, id: PartitionId) -> Found {
    const CREATION: &str = "its creation was cut short";
    if dir.join(DROPPING).exists() {
        return Found::Leftover("its drop was cut short");
    }
    let names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let has_tables = names.iter().any(|name| name.ends_with(".sst"));
    if !has_tables
        && !dir.join("CURRENT").exists()
        && names
            .iter()
            .all(|name| !name.starts_with("MANIFEST-") || name == "MANIFEST-000001")
    {
        return Found::Leftover(CREATION);
    }
    let path = || dir.display().to_string();
    match DB::list_cf(&db_options(), dir) {
        Ok(families) if families.contains(&cf_name(id)) => Found::Store(Ok(families)),
        Ok(_) if !has_tables => Found::Leftover(CREATION),
        Ok(_) => Found::Store(Err(Error::NoColumnFamily {
            path: path(),
            column_family: cf_name(id),
        })),
        Err(source) => Found::Store(Err(Error::Open {
            path: path(),
            source,
        })),
    }
}

/// Renames a partition's folder out of the way (durably), to a name that the next open deletes,
/// then deletes it. A folder already gone (moved away by an operator keeping the files of a store
/// that cannot be opened) is left to them.
fn remove_dropped(store_dir: &Path, dir: &Path) -> Result<()> {
    let mut dropped = dir.as_os_str().to_owned();
    dropped.push(DROPPED_SUFFIX);
    let dropped = PathBuf::from(dropped);
    match std::fs::rename(dir, &dropped) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(io_at("move a dropped partition store aside", dir)(err)),
    }
    sync_dir(store_dir).map_err(io_at("move a dropped partition store aside", dir))?;
    std::fs::remove_dir_all(&dropped).map_err(io_at("remove a dropped partition store", &dropped))
}

/// A lock whose data stays consistent if a holder panicked: every map here is changed one whole
/// entry at a time.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Options of a partition's column family. Every partition's tables share `block_cache`, so the
/// node's block cache is `block_cache_bytes` however many partitions it holds.
fn column_family_options(
    options: &StoreOptions,
    block_cache: &rust_rocksdb::Cache,
    expiry: Arc<Expiry>,
) -> Options {
    let mut block = BlockBasedOptions::default();
    block.set_format_version(options.format_version);
    block.set_block_cache(block_cache);
    block.set_bloom_filter(10.0, false);
    block.set_block_size(options.block_bytes);
    let mut cf = Options::default();
    cf.set_block_based_table_factory(&block);
    // A bloom filter over the memtable's whole keys: a lookup of a key the memtable does not hold
    // (most of what insert-if-absent asks about) skips the search of its skip list, which, with
    // keys in hash order, costs a cache miss per level.
    cf.set_memtable_whole_key_filtering(true);
    let memtables = MEMTABLES_PER_FLUSH as i32;
    cf.set_write_buffer_size(options.write_buffer_bytes.div_ceil(MEMTABLES_PER_FLUSH));
    cf.set_min_write_buffer_number_to_merge(memtables);
    // Room for as many again while a flush runs, as RocksDB's default of two memtables gives.
    cf.set_max_write_buffer_number(2 * memtables);
    cf.set_memtable_prefix_bloom_ratio(0.1);
    // LZ4 everywhere: fast, and readable by every RocksDB build that Debian ships.
    cf.set_compression_type(DBCompressionType::Lz4);
    cf.set_bottommost_compression_type(DBCompressionType::Lz4);
    cf.set_compaction_filter_factory(ExpiryFilterFactory(expiry));
    if options.compaction_style == CompactionStyle::Universal {
        cf.set_compaction_style(DBCompactionStyle::Universal);
    }
    // Leveled: until a partition holds a few hundred MiB, all of it is in one level, and every
    // compaction of level 0 rewrites that whole level along with the new files. Eight files
    // instead of RocksDB's four per compaction halve how often it is rewritten: over 100 s of
    // batched puts on 16 partitions, compactions took a fifth of the node's CPU with four, and
    // eight gave 8% more keys/s over the whole run and 13% more in its last 25 s; batched
    // insert-if-absent, whose lookups read up to twice as many level-0 files (most passed over by
    // their bloom filters), came out even. Universal: a merge starts at eight sorted runs.
    cf.set_level_zero_file_num_compaction_trigger(8);
    cf
}

/// One SST file of an export, with RocksDB's live-file metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedFile {
    pub column_family_name: String,
    /// File name with a leading slash, as RocksDB reports it (`/000030.sst`).
    pub name: String,
    pub directory: String,
    pub size: u64,
    pub level: i32,
    pub start_key: Vec<u8>,
    pub end_key: Vec<u8>,
    pub smallest_seqno: u64,
    pub largest_seqno: u64,
    pub num_entries: u64,
    pub num_deletions: u64,
}

impl ExportedFile {
    /// RocksDB's description of an exported file; [`ExportedFile::to_live_file`] is the way
    /// back. The one place where the fields are copied in each direction.
    fn from_live_file(f: rust_rocksdb::LiveFile) -> ExportedFile {
        ExportedFile {
            column_family_name: f.column_family_name,
            name: f.name,
            directory: f.directory,
            size: f.size as u64,
            level: f.level,
            start_key: f.start_key.unwrap_or_default(),
            end_key: f.end_key.unwrap_or_default(),
            smallest_seqno: f.smallest_seqno,
            largest_seqno: f.largest_seqno,
            num_entries: f.num_entries,
            num_deletions: f.num_deletions,
        }
    }

    /// The description RocksDB imports: this file, found in `directory`, into column family
    /// `column_family_name`.
    pub(crate) fn to_live_file(
        &self,
        column_family_name: String,
        directory: String,
    ) -> rust_rocksdb::LiveFile {
        rust_rocksdb::LiveFile {
            column_family_name,
            name: format!("/{}", self.name.trim_start_matches('/')),
            directory,
            size: usize::try_from(self.size).unwrap_or(usize::MAX),
            level: self.level,
            start_key: Some(self.start_key.clone()),
            end_key: Some(self.end_key.clone()),
            smallest_seqno: self.smallest_seqno,
            largest_seqno: self.largest_seqno,
            num_entries: self.num_entries,
            num_deletions: self.num_deletions,
        }
    }
}

/// A column family exported to a folder: what a snapshot is made of.
#[derive(Debug, Clone)]
pub struct ColumnFamilyExport {
    pub dir: PathBuf,
    pub comparator_name: String,
    pub files: Vec<ExportedFile>,
    /// The applied LSN stored in the exported files.
    pub applied_lsn: Lsn,
}

/// How far RocksDB holds back a partition's writes while its compactions catch up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum WriteStall {
    #[default]
    None = 0,
    /// Writes are let through at a reduced rate.
    Slowed = 1,
    /// Writes wait until compactions have caught up.
    Stopped = 2,
}

/// What RocksDB estimates a partition holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SizeEstimates {
    pub keys: u64,
    pub live_sst_bytes: u64,
    pub memtable_bytes: u64,
}

/// One partition's column family.
#[derive(Clone)]
pub struct PartitionStore {
    db: Arc<DB>,
    id: PartitionId,
    cf_name: String,
    expiry: Arc<Expiry>,
}

impl PartitionStore {
    pub fn id(&self) -> PartitionId {
        self.id
    }

    fn cf(&self) -> Result<Arc<BoundColumnFamily<'_>>> {
        self.db
            .cf_handle(&self.cf_name)
            .ok_or(Error::UnknownPartition(self.id))
    }

    fn get_raw(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.db
            .get_cf(&self.cf()?, key)
            .map_err(|source| Error::RocksDb {
                context: "read",
                source,
            })
    }

    /// The value stored under `key`, expired or not: the caller decides with
    /// [`StoredValue::is_live_at`], using whatever clock its determinism demands.
    pub fn get(&self, key: &[u8]) -> Result<Option<StoredValue>> {
        self.get_raw(&keys::data_key(key))?
            .map(|raw| self.decode_stored(&raw))
            .transpose()
    }

    /// The values stored under `keys`, in order, expired or not, read in one batched lookup.
    pub fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<StoredValue>>> {
        let cf = self.cf()?;
        let data_keys: Vec<Vec<u8>> = keys.iter().map(|k| keys::data_key(k.as_ref())).collect();
        self.db
            .batched_multi_get_cf(&cf, &data_keys, false)
            .into_iter()
            .map(|raw| {
                let raw = raw.map_err(|source| Error::RocksDb {
                    context: "read",
                    source,
                })?;
                raw.map(|raw| self.decode_stored(&raw)).transpose()
            })
            .collect()
    }

    /// [`multi_get`](Self::multi_get) from what RocksDB holds in memory only (memtables, block
    /// cache, open tables' filters and indexes): `None` as soon as a key would need a disk read.
    /// It never waits for I/O, so an async task may call it for a few keys.
    pub fn multi_get_cached<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Option<Vec<Option<StoredValue>>>> {
        let cf = self.cf()?;
        let data_keys: Vec<Vec<u8>> = keys.iter().map(|k| keys::data_key(k.as_ref())).collect();
        let mut options = rust_rocksdb::ReadOptions::default();
        options.set_read_tier(rust_rocksdb::ReadTier::BlockCache);
        let mut values = Vec::with_capacity(keys.len());
        for raw in self
            .db
            .batched_multi_get_cf_opt(&cf, &data_keys, false, &options)
        {
            match raw {
                Ok(raw) => values.push(raw.map(|raw| self.decode_stored(&raw)).transpose()?),
                Err(e) if e.kind() == rust_rocksdb::ErrorKind::Incomplete => return Ok(None),
                Err(source) => {
                    return Err(Error::RocksDb {
                        context: "read",
                        source,
                    });
                }
            }
        }
        Ok(Some(values))
    }

    fn decode_stored(&self, raw: &[u8]) -> Result<StoredValue> {
        let (expires_at_ms, value) = keys::decode_value(raw).map_err(|err| Error::Corrupt {
            partition: self.id,
            what: "value",
            detail: err.to_string(),
        })?;
        Ok(StoredValue {
            value,
            expires_at_ms,
        })
    }

    /// LSN of the last log record applied to this store; 0 if none.
    pub fn applied_lsn(&self) -> Result<Lsn> {
        match self.get_raw(&keys::fsm_key(FSM_APPLIED_LSN))? {
            None => Ok(Lsn::ZERO),
            Some(raw) => {
                let bytes: [u8; 8] = raw.as_slice().try_into().map_err(|_| Error::Corrupt {
                    partition: self.id,
                    what: "applied LSN",
                    detail: format!("{} bytes instead of 8", raw.len()),
                })?;
                Ok(Lsn(u64::from_be_bytes(bytes)))
            }
        }
    }

    /// The partition's time: the latest record timestamp the processor applied (ms since the
    /// Unix epoch); 0 before the first.
    pub fn partition_time(&self) -> Result<u64> {
        let raw = self.get_raw(&keys::fsm_key(FSM_PARTITION_TIME))?;
        self.decode_partition_time(raw)
    }

    /// The partition time of what this store has on disk, without its memtables: what it would
    /// reopen with after a crash. Only that time bounds what compactions may drop, since they
    /// rewrite files on disk whose contents a crash would not roll back.
    pub fn persisted_partition_time(&self) -> Result<u64> {
        let mut options = rust_rocksdb::ReadOptions::default();
        options.set_read_tier(rust_rocksdb::ReadTier::Persisted);
        let raw = self
            .db
            .get_cf_opt(&self.cf()?, keys::fsm_key(FSM_PARTITION_TIME), &options)
            .map_err(|source| Error::RocksDb {
                context: "read the persisted partition time",
                source,
            })?;
        self.decode_partition_time(raw)
    }

    fn decode_partition_time(&self, raw: Option<Vec<u8>>) -> Result<u64> {
        let Some(raw) = raw else { return Ok(0) };
        let bytes: [u8; 8] = raw.as_slice().try_into().map_err(|_| Error::Corrupt {
            partition: self.id,
            what: "partition time",
            detail: format!("{} bytes instead of 8", raw.len()),
        })?;
        Ok(u64::from_be_bytes(bytes))
    }

    /// Lets compactions drop values that expire at or before `horizon_ms`, from the next
    /// compaction on. The horizon never moves back. The caller guarantees that no decision this
    /// store can still take, now or after a crash, looks at a time before it.
    pub fn set_expiry_horizon(&self, horizon_ms: u64) {
        self.expiry.advance(horizon_ms);
    }

    pub fn expiry_horizon(&self) -> u64 {
        self.expiry.horizon_ms()
    }

    /// Expired values that compactions dropped since the store was opened.
    pub fn expired_dropped(&self) -> u64 {
        self.expiry.dropped()
    }

    /// Flushes the memtable and compacts the whole partition down to its last level, so that
    /// every expired value the horizon allows is dropped now and the space is returned. Blocks
    /// for as long as that takes.
    pub fn compact(&self) -> Result<()> {
        self.flush()?;
        let mut options = rust_rocksdb::CompactOptions::default();
        // Rewrite the last level too: that is where most expired values sit, and where the
        // tombstones the filter leaves are finally dropped.
        options.set_bottommost_level_compaction(rust_rocksdb::BottommostLevelCompaction::Force);
        options.set_exclusive_manual_compaction(false);
        let errors_before = self.background_errors()?;
        self.db
            .compact_range_cf_opt(&self.cf()?, None::<&[u8]>, None::<&[u8]>, &options);
        if self.background_errors()? > errors_before {
            return Err(Error::CompactionFailed(self.id));
        }
        Ok(())
    }

    /// Background errors (failed flushes and compactions, and compactions refused for want of
    /// disk space) RocksDB counted since it opened.
    pub fn background_errors(&self) -> Result<u64> {
        self.int_property(None, "rocksdb.background-errors")
    }

    /// Whether RocksDB is holding back the partition's writes because its compactions are
    /// behind (too many sorted runs or too much data waiting to be compacted). Blocks briefly.
    pub fn write_stall(&self) -> Result<WriteStall> {
        if self.int_property(None, "rocksdb.is-write-stopped")? > 0 {
            Ok(WriteStall::Stopped)
        } else if self.int_property(None, "rocksdb.actual-delayed-write-rate")? > 0 {
            Ok(WriteStall::Slowed)
        } else {
            Ok(WriteStall::None)
        }
    }

    /// An integer property of the partition's column family (`cf`), or of the whole store.
    fn int_property(&self, cf: Option<&Arc<BoundColumnFamily<'_>>>, name: &str) -> Result<u64> {
        let value = match cf {
            Some(cf) => self.db.property_int_value_cf(cf, name),
            None => self.db.property_int_value(name),
        };
        value
            .map(|v| v.unwrap_or(0))
            .map_err(|source| Error::RocksDb {
                context: "read a property",
                source,
            })
    }

    /// RocksDB's estimates for the partition: keys (live and expired-but-not-yet-dropped alike,
    /// which it cannot tell apart) and bytes of its live SST files.
    pub fn size_estimates(&self) -> Result<SizeEstimates> {
        let cf = self.cf()?;
        let property = |name: &str| self.int_property(Some(&cf), name);
        Ok(SizeEstimates {
            keys: property("rocksdb.estimate-num-keys")?,
            live_sst_bytes: property("rocksdb.live-sst-files-size")?,
            memtable_bytes: property("rocksdb.cur-size-all-mem-tables")?,
        })
    }

    /// Reads up to `max` data values (and at most about `bytes_max` bytes of them) from `start`
    /// (a partition key) on, wrapping around to the partition's first key, and counts how many
    /// of them have expired at `now_ms`: a sample for estimating what a compaction would
    /// reclaim, which RocksDB cannot tell by itself. Returns (values read, expired among them).
    /// Blocks for the reads.
    pub fn sample_expired(
        &self,
        now_ms: u64,
        start: u64,
        max: usize,
        bytes_max: usize,
    ) -> Result<(u64, u64)> {
        let cf = self.cf()?;
        let (mut read, mut expired, mut bytes) = (0u64, 0u64, 0usize);
        let ranges = [
            (keys::data_key_with(start, &[]), None),
            (
                vec![keys::TABLE_DATA],
                Some(keys::data_key_with(start, &[])),
            ),
        ];
        for (from, below) in ranges {
            let mut options = rust_rocksdb::ReadOptions::default();
            options.set_iterate_upper_bound(below.unwrap_or_else(|| vec![keys::TABLE_DATA + 1]));
            let mut iter = self.db.raw_iterator_cf_opt(&cf, options);
            iter.seek(&from);
            while iter.valid() && (read as usize) < max && bytes < bytes_max {
                if let Some(value) = iter.value() {
                    read += 1;
                    bytes += value.len();
                    if keys::expiry_of(value).is_some_and(|at| at <= now_ms) {
                        expired += 1;
                    }
                }
                iter.next();
            }
            iter.status().map_err(|source| Error::RocksDb {
                context: "sample values",
                source,
            })?;
        }
        Ok((read, expired))
    }

    /// The leader this partition last accepted; `None` before the first announcement.
    pub fn leader(&self) -> Result<Option<LeaderState>> {
        let Some(raw) = self.get_raw(&keys::fsm_key(FSM_LEADER))? else {
            return Ok(None);
        };
        if raw.len() < 8 {
            return Err(Error::Corrupt {
                partition: self.id,
                what: "leader",
                detail: format!("{} bytes", raw.len()),
            });
        }
        let (epoch, node) = raw.split_at(8);
        let node = String::from_utf8(node.to_vec()).map_err(|e| Error::Corrupt {
            partition: self.id,
            what: "leader",
            detail: e.to_string(),
        })?;
        Ok(Some(LeaderState {
            epoch: Epoch(u64::from_be_bytes(epoch.try_into().expect("8 bytes"))),
            node: NodeId(node),
        }))
    }

    pub fn write_batch(&self) -> PartitionWriteBatch {
        PartitionWriteBatch {
            bytes: Vec::new(),
            ops: Vec::new(),
        }
    }

    /// Applies `batch` atomically. Not synced: see the crate's *Crash consistency*.
    pub fn commit(&self, batch: PartitionWriteBatch) -> Result<()> {
        let cf = self.cf()?;
        let PartitionWriteBatch { bytes, mut ops } = batch;
        // In key order, each insert into the memtable's skip list starts its search from where
        // the previous one ended rather than from the top. The sort is stable: the last write of
        // a key still wins.
        ops.sort_by(|a, b| bytes[a.key.clone()].cmp(&bytes[b.key.clone()]));
        let mut rocks = WriteBatch::default();
        for op in ops {
            let key = &bytes[op.key];
            match op.value {
                Some(value) => rocks.put_cf(&cf, key, &bytes[value]),
                None => rocks.delete_cf(&cf, key),
            }
        }
        let mut options = WriteOptions::default();
        // The log is the write-ahead log: see the crate's *Crash consistency*.
        options.disable_wal(true);
        self.db
            .write_opt(&rocks, &options)
            .map_err(|source| Error::RocksDb {
                context: "write batch",
                source,
            })
    }

    /// Exports the partition's column family into `target_dir` (which must not exist yet) as hard
    /// links to its SST files, after flushing the memtable. The caller must hold off writers for
    /// the duration if it needs the returned `applied_lsn` to be exactly what the files contain;
    /// the partition processor does so by exporting between two records.
    pub fn export(&self, target_dir: &Path) -> Result<ColumnFamilyExport> {
        let applied_lsn = self.applied_lsn()?;
        let checkpoint = rust_rocksdb::checkpoint::Checkpoint::new(&self.db).map_err(|source| {
            Error::RocksDb {
                context: "create checkpoint",
                source,
            }
        })?;
        let metadata = checkpoint
            .export_column_family(&self.cf()?, target_dir)
            .map_err(|source| Error::RocksDb {
                context: "export column family",
                source,
            })?;
        let files = metadata
            .get_files()
            .into_iter()
            .map(ExportedFile::from_live_file)
            .collect();
        Ok(ColumnFamilyExport {
            dir: target_dir.to_path_buf(),
            comparator_name: metadata.get_db_comparator_name(),
            files,
            applied_lsn,
        })
    }

    /// Whether a compaction of this partition is running or queued, or one would be at the next
    /// chance. The count of running compactions is the partition's database's (for a partition
    /// in the shared database of an older store, that database's).
    pub fn compaction_in_progress(&self) -> Result<bool> {
        let cf = self.cf()?;
        Ok(
            self.int_property(Some(&cf), "rocksdb.compaction-pending")? > 0
                || self.int_property(None, "rocksdb.num-running-compactions")? > 0,
        )
    }

    /// Flushes the partition's memtable to SST files.
    pub fn flush(&self) -> Result<()> {
        self.db
            .flush_cf(&self.cf()?)
            .map_err(|source| Error::RocksDb {
                context: "flush",
                source,
            })
    }
}

/// One write of a [`PartitionWriteBatch`]: where its key and value lie in the batch's bytes.
struct Op {
    key: Range<usize>,
    /// `None`: a delete.
    value: Option<Range<usize>>,
}

/// Writes to one partition, applied together by [`PartitionStore::commit`].
///
/// It records operations instead of holding a RocksDB batch so that it does not borrow a column
/// family handle across the caller's work, and so that they can be sorted by key first. Their
/// keys and values, encoded as the store holds them, go one after the other into one buffer
/// rather than into an allocation each.
pub struct PartitionWriteBatch {
    bytes: Vec<u8>,
    ops: Vec<Op>,
}

impl PartitionWriteBatch {
    pub fn put(&mut self, key: &[u8], value: &[u8], expires_at_ms: Option<u64>) {
        let key = self.append(|out| keys::append_data_key(out, key));
        let value = self.append(|out| keys::append_value(out, expires_at_ms, value));
        self.ops.push(Op {
            key,
            value: Some(value),
        });
    }

    pub fn delete(&mut self, key: &[u8]) {
        let key = self.append(|out| keys::append_data_key(out, key));
        self.ops.push(Op { key, value: None });
    }

    pub fn set_applied_lsn(&mut self, lsn: Lsn) {
        self.put_raw(&keys::fsm_key(FSM_APPLIED_LSN), &lsn.0.to_be_bytes());
    }

    pub fn set_partition_time(&mut self, time_ms: u64) {
        self.put_raw(&keys::fsm_key(FSM_PARTITION_TIME), &time_ms.to_be_bytes());
    }

    pub fn set_leader(&mut self, leader: &LeaderState) {
        let mut raw = leader.epoch.0.to_be_bytes().to_vec();
        raw.extend_from_slice(leader.node.0.as_bytes());
        self.put_raw(&keys::fsm_key(FSM_LEADER), &raw);
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// A put of a key and a value as the store holds them.
    fn put_raw(&mut self, key: &[u8], value: &[u8]) {
        let key = self.append(|out| out.extend_from_slice(key));
        let value = self.append(|out| out.extend_from_slice(value));
        self.ops.push(Op {
            key,
            value: Some(value),
        });
    }

    /// Where what `write` appends to the batch's bytes lies.
    fn append(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> Range<usize> {
        let start = self.bytes.len();
        write(&mut self.bytes);
        start..self.bytes.len()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn open(dir: &Path) -> PartitionStoreManager {
        PartitionStoreManager::open(dir, &StoreOptions::default()).unwrap()
    }

    /// Partition `id`'s store, holding `k` → `v`: in a table file if `flush`, else in memory.
    fn with_one_key(manager: &PartitionStoreManager, id: PartitionId, flush: bool) {
        let store = manager.open_or_create_partition(id).unwrap();
        let mut batch = store.write_batch();
        batch.put(b"k", b"v", None);
        store.commit(batch).unwrap();
        if flush {
            store.flush().unwrap();
        }
    }

    /// The files of `folder` whose names start with `prefix`.
    fn files_named(folder: &Path, prefix: &str) -> Vec<PathBuf> {
        files_where(folder, |name| name.starts_with(prefix))
    }

    /// The files in `folder` whose name `keep` takes.
    fn files_where(folder: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
        std::fs::read_dir(folder)
            .unwrap()
            .map(|file| file.unwrap().path())
            .filter(|path| keep(&path.file_name().unwrap().to_string_lossy()))
            .collect()
    }

    #[test]
    fn data_and_variables_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let manager = open(dir.path());
            let store = manager.open_or_create_partition(PartitionId(3)).unwrap();
            assert_eq!(store.applied_lsn().unwrap(), Lsn::ZERO);
            assert_eq!(store.leader().unwrap(), None);
            let mut batch = store.write_batch();
            batch.put(b"k1", b"v1", None);
            batch.put(b"k2", b"v2", Some(1_000));
            batch.set_applied_lsn(Lsn(7));
            batch.set_leader(&LeaderState {
                epoch: Epoch(2),
                node: NodeId("n1".into()),
            });
            store.commit(batch).unwrap();
        }
        let manager = open(dir.path());
        assert_eq!(manager.partitions(), vec![PartitionId(3)]);
        let store = manager.partition(PartitionId(3)).unwrap();
        assert_eq!(store.applied_lsn().unwrap(), Lsn(7));
        assert_eq!(store.leader().unwrap().unwrap().epoch, Epoch(2));
        let v1 = store.get(b"k1").unwrap().unwrap();
        assert_eq!(&v1.value[..], b"v1");
        assert!(v1.is_live_at(u64::MAX));
        let v2 = store.get(b"k2").unwrap().unwrap();
        assert!(v2.is_live_at(999));
        assert!(!v2.is_live_at(1_000));
        assert_eq!(store.get(b"k3").unwrap(), None);
    }

    #[test]
    fn a_cached_read_answers_from_memory_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        {
            let manager = open(dir.path());
            let store = manager.open_or_create_partition(PartitionId(1)).unwrap();
            let mut batch = store.write_batch();
            batch.put(b"on-disk", b"v1", None);
            store.commit(batch).unwrap();
            store.flush().unwrap();
            let mut batch = store.write_batch();
            batch.put(b"in-memtable", b"v2", Some(1_000));
            store.commit(batch).unwrap();
            let read = store
                .multi_get_cached(&[&b"in-memtable"[..], b"absent"])
                .unwrap()
                .expect("the memtable is memory");
            assert_eq!(&read[0].as_ref().unwrap().value[..], b"v2");
            assert_eq!(read[0].as_ref().unwrap().expires_at_ms, Some(1_000));
            assert_eq!(read[1], None);
        }
        // Reopened: the flushed key is on disk only, until a read brings its block into the cache.
        let manager = open(dir.path());
        let store = manager.partition(PartitionId(1)).unwrap();
        assert_eq!(store.multi_get_cached(&[b"on-disk"]).unwrap(), None);
        let read = store.multi_get(&[b"on-disk"]).unwrap();
        assert_eq!(&read[0].as_ref().unwrap().value[..], b"v1");
        let cached = store.multi_get_cached(&[b"on-disk"]).unwrap();
        assert_eq!(cached, Some(read));
    }

    #[test]
    fn an_export_holds_the_data_and_the_applied_lsn() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(&dir.path().join("db"));
        let store = manager.open_or_create_partition(PartitionId(1)).unwrap();
        let mut batch = store.write_batch();
        batch.put(b"k", b"v", None);
        batch.set_applied_lsn(Lsn(9));
        store.commit(batch).unwrap();

        let target = dir.path().join("export");
        let export = store.export(&target).unwrap();
        assert_eq!(export.applied_lsn, Lsn(9));
        assert_eq!(export.comparator_name, "leveldb.BytewiseComparator");
        assert!(!export.files.is_empty());
        for file in &export.files {
            let on_disk = target.join(file.name.trim_start_matches('/'));
            assert_eq!(
                std::fs::metadata(&on_disk).unwrap().len(),
                file.size,
                "{file:?}"
            );
        }
        // Writes after the export do not change it.
        let mut batch = store.write_batch();
        batch.put(b"k2", b"v2", None);
        store.commit(batch).unwrap();
        assert!(
            store.export(&target).is_err(),
            "exporting into an existing folder must fail"
        );
    }

    #[test]
    fn an_export_imports_into_another_store() {
        let dir = tempfile::tempdir().unwrap();
        let source = open(&dir.path().join("a"));
        let store = source.open_or_create_partition(PartitionId(2)).unwrap();
        write_rounds(&store, 0..3);
        let export = store.export(&dir.path().join("export")).unwrap();
        assert!(export.files.len() >= 3, "{export:?}");

        let target = open(&dir.path().join("b"));
        let imported = import_export(&target, PartitionId(2), &export).unwrap();
        assert_eq!(imported.applied_lsn().unwrap(), Lsn(3));
        assert_eq!(
            &imported.get(b"k1-42").unwrap().unwrap().value[..],
            &[1; 10]
        );
        assert!(matches!(
            target.import_partition(PartitionId(2), &export.dir, "", &[]),
            Err(Error::AlreadyExists(_))
        ));
        // The import survives a reopen: it is the store's own data now.
        drop((imported, target));
        let target = open(&dir.path().join("b"));
        let imported = target.partition(PartitionId(2)).unwrap();
        assert_eq!(
            &imported.get(b"k2-99").unwrap().unwrap().value[..],
            &[2; 10]
        );
    }

    /// Imports `export` into `manager` as partition `id`.
    pub(crate) fn import_export(
        manager: &PartitionStoreManager,
        id: PartitionId,
        export: &ColumnFamilyExport,
    ) -> Result<PartitionStore> {
        manager.import_partition(id, &export.dir, &export.comparator_name, &export.files)
    }

    /// A manager of `dir` whose stores compact in `style`.
    fn open_compacting(dir: &Path, style: CompactionStyle) -> PartitionStoreManager {
        let options = StoreOptions {
            compaction_style: style,
            ..StoreOptions::default()
        };
        PartitionStoreManager::open(dir, &options).unwrap()
    }

    /// Writes keys `k{round}-{i}` (value `[round; 10]`) for each round of `rounds`, one flushed
    /// table per round, with the round's number as the applied LSN.
    fn write_rounds(store: &PartitionStore, rounds: Range<u8>) {
        for round in rounds {
            let mut batch = store.write_batch();
            for i in 0..100u32 {
                batch.put(format!("k{round}-{i}").as_bytes(), &[round; 10], None);
            }
            batch.set_applied_lsn(Lsn(u64::from(round) + 1));
            store.commit(batch).unwrap();
            store.flush().unwrap();
        }
    }

    /// Every key [`write_rounds`] wrote for `rounds` reads back with its value.
    fn assert_rounds(store: &PartitionStore, rounds: Range<u8>) {
        for round in rounds {
            for i in 0..100u32 {
                let key = format!("k{round}-{i}");
                let value = store.get(key.as_bytes()).unwrap();
                assert_eq!(
                    value.as_ref().map(|v| &v.value[..]),
                    Some(&[round; 10][..]),
                    "{key}"
                );
            }
        }
    }

    /// The data blocks of the partition's tables, as RocksDB counts them.
    fn data_blocks(store: &PartitionStore) -> u64 {
        let cf = store.cf().unwrap();
        let properties = store
            .db
            .property_value_cf(&cf, "rocksdb.aggregated-table-properties")
            .unwrap()
            .expect("the tables' properties");
        let count = properties
            .split(';')
            .find_map(|p| p.trim().strip_prefix("# data blocks="))
            .unwrap_or_else(|| panic!("no data block count in {properties:?}"));
        count.trim().parse().unwrap()
    }

    /// Writes keys `key-{i}` with 100-byte values `[i as u8; 100]` for each `i` of `keys` in one
    /// batch, and flushes them into a table.
    fn write_flushed(store: &PartitionStore, keys: Range<u32>) {
        let mut batch = store.write_batch();
        for i in keys {
            batch.put(format!("key-{i}").as_bytes(), &[i as u8; 100], None);
        }
        store.commit(batch).unwrap();
        store.flush().unwrap();
    }

    /// Every key of `keys` that [`write_flushed`] wrote reads back with its value.
    fn assert_flushed(store: &PartitionStore, keys: Range<u32>) {
        for i in keys {
            let value = store.get(format!("key-{i}").as_bytes()).unwrap();
            assert_eq!(
                value.map(|v| v.value),
                Some(Bytes::from(vec![i as u8; 100])),
                "key-{i}"
            );
        }
    }

    /// Partition 0 of the store in `dir`, opened with tables in blocks of `block_bytes`.
    fn partition_in_blocks(dir: &Path, block_bytes: usize) -> PartitionStore {
        let options = StoreOptions {
            block_bytes,
            ..StoreOptions::default()
        };
        let manager = PartitionStoreManager::open(dir, &options).unwrap();
        manager.open_or_create_partition(PartitionId(0)).unwrap()
    }

    #[test]
    fn tables_are_written_in_blocks_of_the_configured_size() {
        let blocks_of = |block_bytes: usize| {
            let dir = tempfile::tempdir().unwrap();
            let store = partition_in_blocks(dir.path(), block_bytes);
            write_flushed(&store, 0..2_000);
            assert_flushed(&store, 0..2_000);
            data_blocks(&store)
        };
        // About 300 KB of keys and values before compression.
        let (small, large) = (blocks_of(4 * 1024), blocks_of(64 * 1024));
        assert!(
            small >= 50 && large <= 8,
            "{small} blocks of 4 KiB, {large} of 64 KiB"
        );
        assert_eq!(StoreOptions::default().block_bytes, 16 * 1024);
    }

    #[test]
    fn a_store_written_in_other_blocks_opens_and_serves_its_keys() {
        let dir = tempfile::tempdir().unwrap();
        write_flushed(&partition_in_blocks(dir.path(), 4 * 1024), 0..2_000);
        let store = partition_in_blocks(dir.path(), 64 * 1024);
        assert_flushed(&store, 0..2_000);
        let old = data_blocks(&store);
        assert!(old >= 50, "{old} blocks of 4 KiB");
        // A new table is written in the new size, and the old one is still read.
        write_flushed(&store, 2_000..4_000);
        let added = data_blocks(&store) - old;
        assert!(added <= 8, "{added} blocks of 64 KiB");
        assert_flushed(&store, 0..4_000);
    }

    /// The levels of the partition's live tables, from the top.
    fn levels(store: &PartitionStore) -> Vec<i32> {
        let mut levels: Vec<i32> = (store.db.live_files().unwrap().into_iter())
            .filter(|f| f.column_family_name == store.cf_name)
            .map(|f| f.level)
            .collect();
        levels.sort();
        levels.dedup();
        levels
    }

    #[test]
    fn a_store_opens_under_the_other_compaction_style() {
        use CompactionStyle::{Leveled, Universal};
        let dir = tempfile::tempdir().unwrap();
        // Written leveled: a compacted last level, and two newer tables in level 0.
        {
            let manager = open_compacting(dir.path(), Leveled);
            let store = manager.open_or_create_partition(PartitionId(1)).unwrap();
            write_rounds(&store, 0..3);
            store.compact().unwrap();
            write_rounds(&store, 3..5);
            assert_eq!(levels(&store), [0, 6]);
        }
        // Universal takes it as it is, and its own compactions merge it with new tables.
        {
            let manager = open_compacting(dir.path(), Universal);
            let store = manager.partition(PartitionId(1)).unwrap();
            assert_rounds(&store, 0..5);
            write_rounds(&store, 5..7);
            store.compact().unwrap();
            assert_eq!(levels(&store), [6]);
            write_rounds(&store, 7..8);
            assert_rounds(&store, 0..8);
            assert_eq!(store.applied_lsn().unwrap(), Lsn(8));
        }
        // And back: what universal wrote opens leveled.
        let manager = open_compacting(dir.path(), Leveled);
        let store = manager.partition(PartitionId(1)).unwrap();
        assert_rounds(&store, 0..8);
        write_rounds(&store, 8..9);
        store.compact().unwrap();
        assert_rounds(&store, 0..9);
    }

    #[test]
    fn an_export_imports_under_the_other_compaction_style() {
        use CompactionStyle::{Leveled, Universal};
        let dir = tempfile::tempdir().unwrap();
        for (from, to) in [(Leveled, Universal), (Universal, Leveled)] {
            let name = format!("{from:?}-{to:?}");
            let source = open_compacting(&dir.path().join(format!("{name}-source")), from);
            let store = source.open_or_create_partition(PartitionId(2)).unwrap();
            write_rounds(&store, 0..3);
            store.compact().unwrap();
            write_rounds(&store, 3..5);
            let export = store
                .export(&dir.path().join(format!("{name}-export")))
                .unwrap();
            let exported_levels: Vec<i32> = export.files.iter().map(|f| f.level).collect();
            assert!(
                exported_levels.contains(&0) && exported_levels.contains(&6),
                "{name}: {exported_levels:?}"
            );

            let target = open_compacting(&dir.path().join(format!("{name}-target")), to);
            let imported = import_export(&target, PartitionId(2), &export).unwrap();
            assert_rounds(&imported, 0..5);
            assert_eq!(imported.applied_lsn().unwrap(), Lsn(5), "{name}");
            // The target's own compactions take the imported tables in.
            write_rounds(&imported, 5..6);
            imported.compact().unwrap();
            assert_eq!(levels(&imported), [6], "{name}");
            assert_rounds(&imported, 0..6);
        }
    }

    #[test]
    fn a_store_whose_compactions_are_behind_says_its_writes_are_held_back() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(1)).unwrap();
        assert_eq!(store.write_stall().unwrap(), WriteStall::None);
        // Two level-0 tables, fewer than a compaction waits for, are more than RocksDB lets
        // writes through at full speed with: compactions behind, as far as it can tell.
        let cf = store.cf().unwrap();
        let set = |options: &[(&str, &str)]| store.db.set_options_cf(&cf, options).unwrap();
        set(&[("level0_slowdown_writes_trigger", "2")]);
        write_rounds(&store, 0..2);
        assert_eq!(store.write_stall().unwrap(), WriteStall::Slowed);
        set(&[("level0_stop_writes_trigger", "2")]);
        assert_eq!(store.write_stall().unwrap(), WriteStall::Stopped);
        // Once a compaction has caught up, writes go through at full speed.
        store.compact().unwrap();
        assert_eq!(store.write_stall().unwrap(), WriteStall::None);
        assert_rounds(&store, 0..2);
    }

    #[test]
    fn the_last_write_of_a_key_in_a_batch_wins() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let keys: Vec<Vec<u8>> = (0..50u32).map(|i| format!("k{i}").into_bytes()).collect();
        let mut batch = store.write_batch();
        for (i, key) in keys.iter().enumerate() {
            batch.put(key, b"first", None);
            if i % 2 == 0 {
                batch.delete(key);
            }
        }
        for key in keys.iter().rev().step_by(3) {
            batch.put(key, b"last", None);
        }
        store.commit(batch).unwrap();

        for (i, key) in keys.iter().enumerate() {
            let rewritten = (keys.len() - 1 - i).is_multiple_of(3);
            let expected: Option<&[u8]> = match (rewritten, i.is_multiple_of(2)) {
                (true, _) => Some(b"last"),
                (false, true) => None,
                (false, false) => Some(b"first"),
            };
            let got = store.get(key).unwrap();
            assert_eq!(got.as_ref().map(|v| &v.value[..]), expected, "key {i}");
        }
    }

    #[test]
    fn the_persisted_partition_time_is_what_a_crash_would_leave() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let set_time = |time| {
            let mut batch = store.write_batch();
            batch.set_partition_time(time);
            store.commit(batch).unwrap();
        };
        set_time(100);
        assert_eq!(store.partition_time().unwrap(), 100);
        // Only in the memtable, which a crash loses: nothing on disk yet.
        assert_eq!(store.persisted_partition_time().unwrap(), 0);
        store.flush().unwrap();
        set_time(200);
        assert_eq!(store.persisted_partition_time().unwrap(), 100);
        assert_eq!(store.partition_time().unwrap(), 200);
    }

    #[test]
    fn compaction_drops_values_expired_by_the_horizon_only() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let mut batch = store.write_batch();
        for (key, expiry) in [
            ("a", Some(10)),
            ("b", Some(20)),
            ("c", Some(21)),
            ("d", None),
        ] {
            batch.put(key.as_bytes(), b"v", expiry);
        }
        store.commit(batch).unwrap();
        store.flush().unwrap();
        // Rewritten with an expiry: once that passes, the key is gone, not back to its old value.
        let mut batch = store.write_batch();
        batch.put(b"d", b"newer", Some(5));
        store.commit(batch).unwrap();

        store.compact().unwrap();
        assert_eq!(
            store.expired_dropped(),
            0,
            "no horizon yet: nothing dropped"
        );
        store.set_expiry_horizon(20);
        store.compact().unwrap();
        assert_eq!(store.expired_dropped(), 3);
        let present: Vec<bool> = ["a", "b", "c", "d"]
            .iter()
            .map(|k| store.get(k.as_bytes()).unwrap().is_some())
            .collect();
        assert_eq!(present, [false, false, true, false]);
        // The horizon never goes back.
        store.set_expiry_horizon(1);
        assert_eq!(store.expiry_horizon(), 20);
    }

    #[test]
    fn a_sample_wraps_around_and_counts_the_expired() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let mut batch = store.write_batch();
        for i in 0..10u64 {
            let expiry = (i < 4).then_some(50);
            batch.put(format!("k{i}").as_bytes(), &[0; 100], expiry);
        }
        store.commit(batch).unwrap();
        // From the middle of the key space: the values before it are read after the wrap.
        assert_eq!(
            store
                .sample_expired(100, u64::MAX / 2, 1000, 1 << 20)
                .unwrap(),
            (10, 4)
        );
        assert_eq!(
            store
                .sample_expired(10, u64::MAX / 2, 1000, 1 << 20)
                .unwrap(),
            (10, 0)
        );
        assert_eq!(store.sample_expired(100, 0, 3, 1 << 20).unwrap().0, 3);
        // Bounded by bytes too: each stored value is 109 bytes.
        assert_eq!(store.sample_expired(100, 0, 1000, 300).unwrap().0, 3);
    }

    #[test]
    fn multi_get_answers_each_key_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let mut batch = store.write_batch();
        batch.put(b"a", b"1", None);
        batch.put(b"c", b"3", Some(50));
        store.commit(batch).unwrap();
        store.flush().unwrap();
        let mut batch = store.write_batch();
        batch.put(b"b", b"2", None);
        store.commit(batch).unwrap();

        let got = store
            .multi_get(&[&b"c"[..], b"x", b"a", b"b", b"a"])
            .unwrap();
        let values: Vec<Option<&[u8]>> = got
            .iter()
            .map(|v| v.as_ref().map(|v| &v.value[..]))
            .collect();
        assert_eq!(
            values,
            [Some(&b"3"[..]), None, Some(b"1"), Some(b"2"), Some(b"1")]
        );
        assert_eq!(got[0].as_ref().unwrap().expires_at_ms, Some(50));
    }

    #[test]
    fn background_work_settles() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        for i in 0..8u32 {
            let mut batch = store.write_batch();
            batch.put(&i.to_be_bytes(), b"v", None);
            store.commit(batch).unwrap();
            store.flush().unwrap();
        }
        manager.wait_for_background_work().unwrap();
        assert!(!store.compaction_in_progress().unwrap());
    }

    /// The node's block cache is one, whatever the number of partitions: a read of each
    /// partition's tables goes through it (before, each column family had a cache of
    /// `block_cache_bytes` of its own).
    #[test]
    fn every_partition_reads_through_the_one_block_cache() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let mut usage = manager.block_cache.get_usage();
        for id in [PartitionId(0), PartitionId(1), PartitionId(2)] {
            let store = manager.open_or_create_partition(id).unwrap();
            let mut batch = store.write_batch();
            batch.put(b"k", &[7u8; 4096], None);
            store.commit(batch).unwrap();
            store.flush().unwrap();
            assert!(store.get(b"k").unwrap().is_some());
            let now = manager.block_cache.get_usage();
            assert!(
                now > usage,
                "a read of partition {id} did not go through the node's block cache"
            );
            usage = now;
        }
    }

    /// Commits key `n` (big-endian) with 1 KiB of bytes that do not compress, derived from `n`.
    fn put_incompressible_kib(store: &PartitionStore, n: u64) {
        let mut batch = store.write_batch();
        let value: Vec<u8> = (0..128u64)
            .flat_map(|i| {
                (n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03))
                    .to_le_bytes()
            })
            .collect();
        batch.put(&n.to_be_bytes(), &value, None);
        store.commit(batch).unwrap();
    }

    /// A partition's write buffer is filled as several small memtables, which are flushed
    /// together: writing the whole buffer leaves one level-0 file, not one per memtable.
    #[test]
    fn the_memtables_of_a_write_buffer_are_flushed_as_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let write_buffer_bytes = 1024 * 1024;
        let options = StoreOptions {
            write_buffer_bytes,
            ..StoreOptions::default()
        };
        let manager = PartitionStoreManager::open(dir.path(), &options).unwrap();
        let store = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let files = || {
            let live = store.db.live_files().unwrap();
            live.iter()
                .filter(|f| f.column_family_name == store.cf_name)
                .count()
        };
        let immutable = || {
            let cf = store.cf().unwrap();
            store
                .int_property(Some(&cf), "rocksdb.num-immutable-mem-table")
                .unwrap()
        };
        let mut next = 0u64;
        let mut write = |bytes: usize| {
            for _ in 0..bytes / 1024 {
                next += 1;
                put_incompressible_kib(&store, next);
            }
        };
        write(write_buffer_bytes * 3 / 4);
        manager.wait_for_background_work().unwrap();
        assert_eq!(files(), 0, "flushed before the write buffer was full");
        assert!(
            immutable() >= MEMTABLES_PER_FLUSH as u64 / 2,
            "three quarters of the write buffer fill {} full memtables, not several",
            immutable()
        );
        write(write_buffer_bytes / 2);
        manager.wait_for_background_work().unwrap();
        assert_eq!(files(), 1, "the full write buffer was flushed as one file");
        assert!(store.get(&1u64.to_be_bytes()).unwrap().is_some());
    }

    /// The memtables of all partitions together stay within the budget: partitions that write
    /// past it flush early, though none of them filled its own write buffer.
    #[test]
    fn every_partitions_memtables_stay_within_one_budget() {
        let dir = tempfile::tempdir().unwrap();
        let budget = 4 * 1024 * 1024;
        let options = StoreOptions {
            write_buffer_bytes: 8 * 1024 * 1024,
            write_buffer_budget_bytes: budget,
            ..StoreOptions::default()
        };
        let manager = PartitionStoreManager::open(dir.path(), &options).unwrap();
        let stores: Vec<_> = (0..8)
            .map(|p| manager.open_or_create_partition(PartitionId(p)).unwrap())
            .collect();
        let memtable_bytes = |store: &PartitionStore| {
            let cf = store.cf().unwrap();
            store
                .int_property(Some(&cf), "rocksdb.size-all-mem-tables")
                .unwrap()
        };
        let mut peak = 0;
        // 2 MiB per partition, a quarter of its own write buffer: 16 MiB in all, four times the
        // budget.
        for round in 0..2048u64 {
            for store in &stores {
                put_incompressible_kib(store, round);
            }
            if round % 64 == 63 {
                let held: u64 = stores.iter().map(memtable_bytes).sum();
                peak = peak.max(held);
            }
        }
        manager.wait_for_background_work().unwrap();
        let flushed = stores
            .iter()
            .filter(|store| {
                store
                    .db
                    .live_files()
                    .unwrap()
                    .iter()
                    .any(|f| f.column_family_name == store.cf_name)
            })
            .count();
        assert!(
            flushed > 0,
            "no partition flushed, though all held 4x the budget"
        );
        // Flushes run in the background while writes go on: allow them a write buffer's worth.
        assert!(
            peak <= (budget + 8 * 1024 * 1024) as u64,
            "the partitions held {peak} bytes of memtables at once, over the budget of {budget}"
        );
        for store in &stores {
            assert!(store.get(&0u64.to_be_bytes()).unwrap().is_some());
        }
    }

    #[test]
    fn partitions_are_isolated_and_droppable() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let a = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let b = manager.open_or_create_partition(PartitionId(1)).unwrap();
        let mut batch = a.write_batch();
        batch.put(b"k", b"a", None);
        a.commit(batch).unwrap();
        assert_eq!(b.get(b"k").unwrap(), None);

        let mut batch = a.write_batch();
        batch.delete(b"k");
        a.commit(batch).unwrap();
        assert_eq!(a.get(b"k").unwrap(), None);

        manager.drop_partition(PartitionId(0)).unwrap();
        assert!(manager.partition(PartitionId(0)).is_none());
        assert!(matches!(a.get(b"k"), Err(Error::UnknownPartition(_))));
        drop((a, b, manager));
        assert_eq!(open(dir.path()).partitions(), vec![PartitionId(1)]);
    }

    /// Each partition is a database of its own: a partition's store is dropped and made again
    /// while a handle on the old one is still held, and the old handle neither reads nor writes
    /// the new store.
    #[test]
    fn a_dropped_store_still_held_does_not_touch_its_successor() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        let old = manager.open_or_create_partition(PartitionId(0)).unwrap();
        let mut batch = old.write_batch();
        batch.put(b"k", b"old", None);
        old.commit(batch).unwrap();
        let old_dir = manager.partition_dir(PartitionId(0)).unwrap();

        manager.drop_partition(PartitionId(0)).unwrap();
        assert!(!old_dir.exists(), "the dropped store's folder is gone");
        let new = manager.open_or_create_partition(PartitionId(0)).unwrap();
        assert_ne!(manager.partition_dir(PartitionId(0)).unwrap(), old_dir);
        assert_eq!(new.get(b"k").unwrap(), None);
        let mut batch = new.write_batch();
        batch.put(b"k", b"new", None);
        new.commit(batch).unwrap();
        assert!(old.get(b"k").is_err());
        let mut batch = old.write_batch();
        batch.put(b"k", b"stale", None);
        assert!(old.commit(batch).is_err());
        drop(old);

        drop((new, manager));
        let manager = open(dir.path());
        let stored = manager
            .partition(PartitionId(0))
            .unwrap()
            .get(b"k")
            .unwrap();
        assert_eq!(&stored.unwrap().value[..], b"new");
        let folders = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(folders, 1, "one folder for the one partition");
    }

    /// A drop that a crash cut short leaves a folder renamed aside: the next open deletes it.
    /// Two folders for one partition are refused, naming both.
    #[test]
    fn leftover_and_doubled_partition_folders() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).open_or_create_partition(PartitionId(3)));
        let leftover = dir.path().join("partition-3.0.dropped");
        std::fs::create_dir(&leftover).unwrap();
        std::fs::write(leftover.join("000007.sst"), b"half deleted").unwrap();
        let manager = open(dir.path());
        assert!(!leftover.exists());
        assert_eq!(manager.partitions(), vec![PartitionId(3)]);
        let current = manager.partition_dir(PartitionId(3)).unwrap();
        drop(manager);

        let copy = dir.path().join("partition-3.9");
        std::fs::create_dir(&copy).unwrap();
        for file in std::fs::read_dir(&current).unwrap() {
            let file = file.unwrap();
            std::fs::copy(file.path(), copy.join(file.file_name())).unwrap();
        }
        match PartitionStoreManager::open(dir.path(), &StoreOptions::default()) {
            Err(Error::TwoStores { partition, .. }) => assert_eq!(partition, PartitionId(3)),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("two stores of one partition were opened"),
        }
    }

    /// A crash while a partition's database was being created leaves a folder with no database
    /// in it yet, or a database without the partition's column family: the next open removes
    /// it, and the partition has no store, as before the creation.
    #[test]
    fn a_creation_cut_short_leaves_no_store() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).open_or_create_partition(PartitionId(1)));
        let no_database = dir.path().join("partition-2.5");
        std::fs::create_dir(&no_database).unwrap();
        std::fs::write(no_database.join("MANIFEST-000001"), b"").unwrap();
        let no_column_family = dir.path().join("partition-3.6");
        let mut options = db_options();
        options.create_if_missing(true);
        drop(DB::open(&options, &no_column_family).unwrap());

        let manager = open(dir.path());
        assert_eq!(manager.partitions(), vec![PartitionId(1)]);
        assert!(!no_database.exists() && !no_column_family.exists());
        let three = manager.open_or_create_partition(PartitionId(3)).unwrap();
        assert_eq!(three.applied_lsn().unwrap(), Lsn::ZERO);
        let created = manager.partition_dir(PartitionId(3)).unwrap();
        assert_eq!(
            created,
            dir.path().join("partition-3.7"),
            "a new generation"
        );
    }

    /// A store that lost its `CURRENT` but holds tables is damaged, not a creation cut short:
    /// nothing deletes it, and its partition is left out until it is dropped. A file with a
    /// partition folder's name is passed over, and a dropped one's generation is not used again.
    #[test]
    fn a_store_that_lost_current_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        with_one_key(&manager, PartitionId(7), true);
        let folder = manager.partition_dir(PartitionId(7)).unwrap();
        drop(manager);
        std::fs::remove_file(folder.join("CURRENT")).unwrap();
        std::fs::write(dir.path().join("partition-3.40"), b"not a folder").unwrap();
        std::fs::create_dir(dir.path().join("partition-2.50.dropped")).unwrap();

        let manager = open(dir.path());
        assert!(folder.exists(), "the tables are still there");
        assert!(manager.partition(PartitionId(7)).is_none());
        let why = manager.unopened(PartitionId(7)).unwrap();
        assert!(why.is_damaged(), "{why}");
        assert!(dir.path().join("partition-3.40").exists());
        assert!(!dir.path().join("partition-2.50.dropped").exists());
        manager.open_or_create_partition(PartitionId(2)).unwrap();
        assert_eq!(
            manager.partition_dir(PartitionId(2)).unwrap(),
            dir.path().join("partition-2.51")
        );
    }

    /// A drop that a crash cut short after it began to change the database (the folder marked,
    /// its column family dropped, tables left behind) is finished by the next open.
    #[test]
    fn a_drop_cut_short_after_the_mark_is_finished() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        with_one_key(&manager, PartitionId(6), true);
        let folder = manager.partition_dir(PartitionId(6)).unwrap();
        drop(manager);
        std::fs::write(folder.join(DROPPING), b"").unwrap();

        let manager = open(dir.path());
        assert!(!folder.exists());
        assert!(!manager.has_store(PartitionId(6)));
    }

    /// A description cut short (RocksDB then lists only the column families it got to) and a
    /// store under another partition's name are damage: kept, never deleted. A name not written
    /// as this store writes them (`partition-03.…`) is passed over.
    #[test]
    fn a_store_whose_description_is_cut_short_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        for id in [PartitionId(3), PartitionId(4)] {
            with_one_key(&manager, id, true);
        }
        let three = manager.partition_dir(PartitionId(3)).unwrap();
        let four = manager.partition_dir(PartitionId(4)).unwrap();
        drop(manager);
        for manifest in files_named(&three, "MANIFEST") {
            std::fs::File::options()
                .write(true)
                .open(&manifest)
                .unwrap()
                .set_len(150)
                .unwrap();
        }
        let renamed = dir.path().join("partition-9.90");
        std::fs::rename(&four, &renamed).unwrap();
        let zero = dir.path().join("partition-05.91");
        std::fs::create_dir(&zero).unwrap();

        let tables = |folder: &Path| files_where(folder, |name| name.ends_with(".sst")).len();
        let before = (tables(&three), tables(&renamed));
        let manager = open(dir.path());
        assert!(three.exists() && renamed.exists() && zero.exists());
        assert_eq!(
            (tables(&three), tables(&renamed)),
            before,
            "no table was deleted"
        );
        assert!(before.0 > 0 && before.1 > 0);
        assert!(manager.unopened(PartitionId(3)).is_some());
        assert!(manager.unopened(PartitionId(9)).is_some());
        assert!(!manager.has_store(PartitionId(5)));
    }

    /// A partition whose database cannot be opened (its description is gone) leaves the other
    /// partitions open; it still has a store, which nothing replaces until it is dropped.
    #[test]
    fn a_database_that_cannot_be_opened_keeps_only_its_partition_out() {
        let dir = tempfile::tempdir().unwrap();
        let manager = open(dir.path());
        for id in [PartitionId(1), PartitionId(2)] {
            with_one_key(&manager, id, false);
        }
        let damaged = manager.partition_dir(PartitionId(2)).unwrap();
        drop(manager);
        for manifest in files_named(&damaged, "MANIFEST") {
            std::fs::remove_file(manifest).unwrap();
        }

        let manager = open(dir.path());
        let one = manager.partition(PartitionId(1)).unwrap();
        assert_eq!(&one.get(b"k").unwrap().unwrap().value[..], b"v");
        assert!(manager.partition(PartitionId(2)).is_none());
        assert!(manager.has_store(PartitionId(2)));
        let why = manager.unopened(PartitionId(2)).unwrap();
        assert!(why.is_damaged(), "{why}");
        assert_eq!(why.path(), Some(damaged.to_str().unwrap()));
        assert!(matches!(
            manager.open_or_create_partition(PartitionId(2)),
            Err(Error::NotOpened { .. })
        ));
        assert!(matches!(
            manager.import_partition(PartitionId(2), dir.path(), "", &[]),
            Err(Error::AlreadyExists(_))
        ));

        manager.drop_partition(PartitionId(2)).unwrap();
        assert!(!damaged.exists());
        let two = manager.open_or_create_partition(PartitionId(2)).unwrap();
        assert_eq!(two.get(b"k").unwrap(), None);
    }

    /// A store written when every partition was a column family of one database opens and
    /// serves as it is; a partition dropped and imported again gets a database of its own, and
    /// new partitions get one from the start.
    #[test]
    fn a_store_of_one_database_for_every_partition_still_serves() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut options = db_options();
            options.create_if_missing(true);
            let db = DB::open_cf(&options, dir.path(), ["data-4", "data-6"]).unwrap();
            for name in ["data-4", "data-6"] {
                let cf = db.cf_handle(name).unwrap();
                let (mut key, mut value) = (Vec::new(), Vec::new());
                keys::append_data_key(&mut key, b"k");
                keys::append_value(&mut value, None, name.as_bytes());
                db.put_cf(&cf, key, value).unwrap();
                db.put_cf(&cf, keys::fsm_key(FSM_APPLIED_LSN), 5u64.to_be_bytes())
                    .unwrap();
            }
            db.flush_cf(&db.cf_handle("data-4").unwrap()).unwrap();
            db.flush_cf(&db.cf_handle("data-6").unwrap()).unwrap();
        }
        let manager = open(dir.path());
        assert_eq!(manager.partitions(), vec![PartitionId(4), PartitionId(6)]);
        let four = manager.partition(PartitionId(4)).unwrap();
        assert_eq!(four.applied_lsn().unwrap(), Lsn(5));
        assert_eq!(&four.get(b"k").unwrap().unwrap().value[..], b"data-4");
        assert_eq!(manager.partition_dir(PartitionId(4)).unwrap(), dir.path());
        manager.check_writable(PartitionId(4)).unwrap();

        let export = four.export(&dir.path().join("export")).unwrap();
        drop(four);
        manager.drop_partition(PartitionId(4)).unwrap();
        let four = import_export(&manager, PartitionId(4), &export).unwrap();
        assert_eq!(&four.get(b"k").unwrap().unwrap().value[..], b"data-4");
        assert_ne!(manager.partition_dir(PartitionId(4)).unwrap(), dir.path());
        manager.open_or_create_partition(PartitionId(5)).unwrap();

        drop((four, manager));
        let manager = open(dir.path());
        assert_eq!(
            manager.partitions(),
            vec![PartitionId(4), PartitionId(5), PartitionId(6)]
        );
        let six = manager.partition(PartitionId(6)).unwrap();
        assert_eq!(&six.get(b"k").unwrap().unwrap().value[..], b"data-6");
        assert_eq!(manager.partition_dir(PartitionId(6)).unwrap(), dir.path());
        let four = manager.partition(PartitionId(4)).unwrap();
        assert_eq!(four.applied_lsn().unwrap(), Lsn(5));
    }
}
