//! Commands as clients send them, parsed into what Cairn does for them, with Redis's own error
//! texts for what it refuses.
//!
//! A command that writes is a list of per-key operations ([`WriteOp`]) that the partition that owns
//! each key decides when it applies them from its log, and a [`WriteReply`] that turns their
//! results into the command's reply. A command that reads is a list of keys and a [`ReadReply`].
//! The front end never reads a key to decide a write.

use super::reply::Reply;
use bytes::Bytes;
use cairn_types::limits::{KEY_BYTES_MAX, TTL_MS_MAX, VALUE_BYTES_MAX};
use cairn_types::record::{Action, Condition, Expiry, WriteOp};

/// A parsed command.
#[derive(Debug)]
pub enum Command {
    Read(Read),
    Write(Write),
    /// Commands about the connection or the server, answered without touching a partition.
    Connection(Connection),
    /// Refused before it ran: the reply says why.
    Refused(Reply),
}

#[derive(Debug)]
pub struct Read {
    pub keys: Vec<Bytes>,
    pub reply: ReadReply,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadReply {
    /// `GET`: the value or nil.
    Value,
    /// `MGET`: an array of values or nils.
    Values,
    /// `EXISTS`: how many of the keys (repeats counted) exist.
    Count,
    /// `TTL` (seconds) and `PTTL` (milliseconds).
    Ttl { millis: bool },
}

#[derive(Debug)]
pub struct Write {
    pub ops: Vec<WriteOp>,
    /// Either all operations apply or none (`MSETNX`).
    pub all_or_nothing: bool,
    pub reply: WriteReply,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteReply {
    /// `+OK`, or nil when the condition did not hold (`SET … NX`/`XX`).
    OkOrNil,
    /// The old value or nil (`SET … GET`).
    Old,
    /// 1 if the operation applied, else 0 (`SETNX`, `EXPIRE`, `PERSIST`, `MSETNX`).
    Applied,
    /// How many keys existed (`DEL`, `UNLINK`).
    Existed,
}

#[derive(Debug)]
pub enum Connection {
    Ping(Option<Bytes>),
    Echo(Bytes),
    Hello {
        version: Option<u8>,
        name: Option<Bytes>,
        /// The user name of `AUTH`.
        user: Option<Bytes>,
    },
    Select(Bytes),
    ClientSetName(Bytes),
    ClientGetName,
    ClientId,
    /// `CLIENT SETINFO` and other settings that change nothing here.
    ClientIgnored,
    Command(Vec<Bytes>),
    /// `CONFIG GET`: Cairn's settings are not Redis's, so it names none of them.
    ConfigGet,
    Info(Vec<Bytes>),
    /// `AUTH [username] password`.
    Auth(Vec<Bytes>),
    Quit,
}

impl Write {
    /// Whether every operation is a plain set (no condition, no old value, no kept expiry): such
    /// writes can go as one put, which decides nothing and reads nothing.
    pub fn is_plain_set(&self) -> bool {
        !self.all_or_nothing
            && self.ops.iter().all(|op| {
                op.condition == Condition::Always
                    && !op.return_old
                    && matches!(
                        op.action,
                        Action::Set {
                            expiry: Expiry::Never | Expiry::After(_),
                            ..
                        }
                    )
            })
    }
}

fn wrong_arity(name: &str) -> Reply {
    Reply::error(format!(
        "ERR wrong number of arguments for '{name}' command"
    ))
}

fn syntax_error() -> Reply {
    Reply::error("ERR syntax error")
}

fn not_an_integer() -> Reply {
    Reply::error("ERR value is not an integer or out of range")
}

fn integer(arg: &[u8]) -> Result<i64, Reply> {
    redis_integer(arg).ok_or_else(not_an_integer)
}

/// An integer as Redis reads one (`string2ll`): decimal digits with an optional `-`, no `+`, no
/// leading zeros, no blanks.
pub(super) fn redis_integer(text: &[u8]) -> Option<i64> {
    if text == b"0" {
        return Some(0);
    }
    let digits = text.strip_prefix(b"-").unwrap_or(text);
    if !digits.first().is_some_and(|d| (b'1'..=b'9').contains(d))
        || !digits.iter().all(u8::is_ascii_digit)
    {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// Cairn's bounds on keys: 1 to 4096 bytes (Redis allows an empty key; Cairn does not).
fn key_ok(key: &Bytes) -> Result<(), Reply> {
    if key.is_empty() {
        return Err(Reply::error(format!(
            "ERR empty key: Cairn keys have 1 to {KEY_BYTES_MAX} bytes"
        )));
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(Reply::error(format!(
            "ERR key of {} bytes: Cairn keys have at most {KEY_BYTES_MAX} bytes",
            key.len()
        )));
    }
    Ok(())
}

fn value_ok(value: &Bytes) -> Result<(), Reply> {
    if value.len() > VALUE_BYTES_MAX {
        return Err(Reply::error(format!(
            "ERR value of {} bytes: Cairn values have at most {VALUE_BYTES_MAX} bytes (1 MiB)",
            value.len()
        )));
    }
    Ok(())
}

/// A relative expiry of `amount` seconds (or milliseconds), for a set (which refuses a
/// non-positive one, as Redis does) or for an expire (where it deletes the key).
fn after(amount: i64, millis: bool, command: &str, set: bool) -> Result<Expiry, Reply> {
    let invalid = || Reply::error(format!("ERR invalid expire time in '{command}' command"));
    // Redis refuses seconds whose milliseconds overflow, either way, before it looks at the sign.
    if !millis && amount.checked_mul(1000).is_none() {
        return Err(invalid());
    }
    if amount <= 0 {
        return if set {
            Err(invalid())
        } else {
            Ok(Expiry::At(0))
        };
    }
    let ms = if millis {
        amount as u64
    } else {
        amount as u64 * 1000
    };
    // Beyond Cairn's bound, but said as Redis says it when the time overflows.
    if ms > i64::MAX as u64 {
        return Err(invalid());
    }
    if ms > TTL_MS_MAX {
        return Err(Reply::error(format!(
            "ERR expire time of {ms} ms in '{command}' command: Cairn's limit is {TTL_MS_MAX} ms (10 years)"
        )));
    }
    Ok(Expiry::After(ms))
}

/// An absolute expiry at `at` seconds (or milliseconds) since the Unix epoch.
fn at(at: i64, millis: bool, command: &str, set: bool) -> Result<Expiry, Reply> {
    let invalid = || Reply::error(format!("ERR invalid expire time in '{command}' command"));
    // Redis refuses a time whose milliseconds do not fit a signed 64-bit integer, either way.
    let ms = if millis {
        at
    } else {
        at.checked_mul(1000).ok_or_else(invalid)?
    };
    if at <= 0 {
        return if set {
            Err(invalid())
        } else {
            Ok(Expiry::At(0))
        };
    }
    Ok(Expiry::At(ms as u64))
}

fn set_op(key: Bytes, value: Bytes, expiry: Expiry, condition: Condition, old: bool) -> WriteOp {
    WriteOp {
        key,
        action: Action::Set { value, expiry },
        condition,
        return_old: old,
    }
}

/// Parses one command (`args[0]` is its name), and names it for the metrics: its name in lower
/// case if it is known, else `unknown`.
pub fn parse(args: Vec<Bytes>) -> (&'static str, Command) {
    let Some(name) = args.first() else {
        return (
            "unknown",
            Command::Refused(Reply::error("ERR empty command")),
        );
    };
    let lower = String::from_utf8_lossy(name).to_ascii_lowercase();
    let label = COMMANDS
        .iter()
        .find(|c| c.0 == lower)
        .map_or("unknown", |c| c.0);
    let command = match parse_known(&lower, &args) {
        Ok(Some(command)) => command,
        Ok(None) => Command::Refused(unknown_command(&args)),
        Err(reply) => Command::Refused(reply),
    };
    (label, command)
}

fn unknown_command(args: &[Bytes]) -> Reply {
    let shown: String = args[1..]
        .iter()
        .take(16)
        .map(|a| format!("'{}' ", String::from_utf8_lossy(&a[..a.len().min(128)])))
        .collect();
    Reply::error(format!(
        "ERR unknown command '{}', with args beginning with: {shown}",
        String::from_utf8_lossy(&args[0][..args[0].len().min(128)])
    ))
}

fn parse_known(name: &str, args: &[Bytes]) -> Result<Option<Command>, Reply> {
    let argc = args.len();
    let arity = |ok: bool| if ok { Ok(()) } else { Err(wrong_arity(name)) };
    let read = |keys: Vec<Bytes>, reply| -> Result<Option<Command>, Reply> {
        keys.iter().try_for_each(key_ok)?;
        Ok(Some(Command::Read(Read { keys, reply })))
    };
    let write = |ops: Vec<WriteOp>, all_or_nothing, reply| -> Result<Option<Command>, Reply> {
        for op in &ops {
            key_ok(&op.key)?;
            if let Action::Set { value, .. } = &op.action {
                value_ok(value)?;
            }
        }
        Ok(Some(Command::Write(Write {
            ops,
            all_or_nothing,
            reply,
        })))
    };
    let connection = |c| Ok(Some(Command::Connection(c)));
    match name {
        "get" => {
            arity(argc == 2)?;
            read(vec![args[1].clone()], ReadReply::Value)
        }
        "mget" => {
            arity(argc >= 2)?;
            read(args[1..].to_vec(), ReadReply::Values)
        }
        "exists" => {
            arity(argc >= 2)?;
            read(args[1..].to_vec(), ReadReply::Count)
        }
        "ttl" | "pttl" => {
            arity(argc == 2)?;
            let millis = name == "pttl";
            read(vec![args[1].clone()], ReadReply::Ttl { millis })
        }
        "set" => {
            arity(argc >= 3)?;
            let (op, reply) = parse_set(args)?;
            write(vec![op], false, reply)
        }
        "setnx" => {
            arity(argc == 3)?;
            let op = set_op(
                args[1].clone(),
                args[2].clone(),
                Expiry::Never,
                Condition::IfAbsent,
                false,
            );
            write(vec![op], false, WriteReply::Applied)
        }
        "setex" | "psetex" => {
            arity(argc == 4)?;
            let expiry = after(integer(&args[2])?, name == "psetex", name, true)?;
            let op = set_op(
                args[1].clone(),
                args[3].clone(),
                expiry,
                Condition::Always,
                false,
            );
            write(vec![op], false, WriteReply::OkOrNil)
        }
        "mset" | "msetnx" => {
            arity(argc >= 3 && argc % 2 == 1)?;
            let nx = name == "msetnx";
            let condition = if nx {
                Condition::IfAbsent
            } else {
                Condition::Always
            };
            let ops = args[1..]
                .chunks(2)
                .map(|kv| {
                    set_op(
                        kv[0].clone(),
                        kv[1].clone(),
                        Expiry::Never,
                        condition,
                        false,
                    )
                })
                .collect();
            let reply = if nx {
                WriteReply::Applied
            } else {
                WriteReply::OkOrNil
            };
            write(ops, nx, reply)
        }
        "del" | "unlink" => {
            arity(argc >= 2)?;
            let ops = args[1..]
                .iter()
                .map(|key| WriteOp {
                    key: key.clone(),
                    action: Action::Delete,
                    condition: Condition::Always,
                    return_old: false,
                })
                .collect();
            write(ops, false, WriteReply::Existed)
        }
        "expire" | "pexpire" | "expireat" | "pexpireat" => {
            arity(argc >= 3)?;
            // Options first, as Redis reads them.
            let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
            for option in &args[3..] {
                match option.to_ascii_lowercase().as_slice() {
                    b"nx" => nx = true,
                    b"xx" => xx = true,
                    b"gt" => gt = true,
                    b"lt" => lt = true,
                    _ => {
                        return Err(Reply::error(format!(
                            "ERR Unsupported option {}",
                            String::from_utf8_lossy(option)
                        )));
                    }
                }
            }
            if nx && (xx || gt || lt) {
                return Err(Reply::error(
                    "ERR NX and XX, GT or LT options at the same time are not compatible",
                ));
            }
            if gt && lt {
                return Err(Reply::error(
                    "ERR GT and LT options at the same time are not compatible",
                ));
            }
            let condition = match (nx, xx, gt, lt) {
                (true, ..) => Condition::IfNoExpiry,
                // A key without an expiry counts as expiring never, so GT never holds for it.
                (_, _, true, _) => Condition::IfLater,
                (_, true, _, true) => Condition::IfHasEarlierExpiry,
                (_, false, _, true) => Condition::IfEarlier,
                (_, true, ..) => Condition::IfHasExpiry,
                _ => Condition::IfPresent,
            };
            let amount = integer(&args[2])?;
            let millis = name.starts_with('p');
            let expiry = if name.ends_with("at") {
                at(amount, millis, name, false)?
            } else {
                after(amount, millis, name, false)?
            };
            let op = WriteOp {
                key: args[1].clone(),
                action: Action::Expire { expiry },
                condition,
                return_old: false,
            };
            write(vec![op], false, WriteReply::Applied)
        }
        "persist" => {
            arity(argc == 2)?;
            let op = WriteOp {
                key: args[1].clone(),
                action: Action::Expire {
                    expiry: Expiry::Never,
                },
                condition: Condition::IfHasExpiry,
                return_old: false,
            };
            write(vec![op], false, WriteReply::Applied)
        }
        "ping" => {
            arity(argc <= 2)?;
            connection(Connection::Ping(args.get(1).cloned()))
        }
        "echo" => {
            arity(argc == 2)?;
            connection(Connection::Echo(args[1].clone()))
        }
        "hello" => parse_hello(args).map(Some),
        "select" => {
            arity(argc == 2)?;
            connection(Connection::Select(args[1].clone()))
        }
        "client" => {
            arity(argc >= 2)?;
            let sub = args[1].to_ascii_lowercase();
            match (sub.as_slice(), argc) {
                (b"setname", 3) => connection(Connection::ClientSetName(args[2].clone())),
                (b"getname", 2) => connection(Connection::ClientGetName),
                (b"id", 2) => connection(Connection::ClientId),
                (b"setinfo", 4) => connection(Connection::ClientIgnored),
                (b"setname" | b"getname" | b"id" | b"setinfo", _) => Err(Reply::error(format!(
                    "ERR wrong number of arguments for 'client|{}' command",
                    String::from_utf8_lossy(&sub)
                ))),
                _ => Err(Reply::error(format!(
                    "ERR unknown subcommand '{}'. Try CLIENT HELP.",
                    String::from_utf8_lossy(&args[1])
                ))),
            }
        }
        "command" => connection(Connection::Command(args[1..].to_vec())),
        "info" => connection(Connection::Info(args[1..].to_vec())),
        "config" => {
            arity(argc >= 2)?;
            match args[1].to_ascii_lowercase().as_slice() {
                b"get" if argc >= 3 => connection(Connection::ConfigGet),
                b"get" => Err(Reply::error(
                    "ERR wrong number of arguments for 'config|get' command",
                )),
                _ => Err(Reply::error(format!(
                    "ERR CONFIG {} is not supported: Cairn is configured by its configuration \
                     file and CAIRN_* environment variables",
                    String::from_utf8_lossy(&args[1]).to_uppercase()
                ))),
            }
        }
        "auth" => {
            arity(argc == 2 || argc == 3)?;
            connection(Connection::Auth(args[1..].to_vec()))
        }
        "quit" => connection(Connection::Quit),
        _ => Ok(None),
    }
}

/// `SET key value [NX | XX] [GET] [EX s | PX ms | EXAT s | PXAT ms | KEEPTTL]`.
fn parse_set(args: &[Bytes]) -> Result<(WriteOp, WriteReply), Reply> {
    let mut condition = Condition::Always;
    let mut get = false;
    let mut keep_ttl = false;
    // The expiry option and its argument. As in Redis, an option may be given again (the last
    // one counts) but not with one it excludes, and the options are all read before the
    // argument is: `SET k v EX x NX XX` is a syntax error, not a bad integer.
    let mut timed: Option<(Vec<u8>, &Bytes)> = None;
    let mut i = 3;
    while i < args.len() {
        let option = args[i].to_ascii_lowercase();
        let is_timed = matches!(option.as_slice(), b"ex" | b"px" | b"exat" | b"pxat");
        match option.as_slice() {
            b"nx" if condition != Condition::IfPresent => condition = Condition::IfAbsent,
            b"xx" if condition != Condition::IfAbsent => condition = Condition::IfPresent,
            b"get" => get = true,
            b"keepttl" if timed.is_none() => keep_ttl = true,
            _ if is_timed
                && !keep_ttl
                && timed.as_ref().is_none_or(|(given, _)| *given == option)
                && i + 1 < args.len() =>
            {
                timed = Some((option, &args[i + 1]));
                i += 1;
            }
            _ => return Err(syntax_error()),
        }
        i += 1;
    }
    let expiry = match timed {
        Some((option, amount)) => {
            let amount = integer(amount)?;
            let millis = option.starts_with(b"p");
            if option.ends_with(b"at") {
                at(amount, millis, "set", true)?
            } else {
                after(amount, millis, "set", true)?
            }
        }
        None if keep_ttl => Expiry::Keep,
        None => Expiry::Never,
    };
    let op = set_op(args[1].clone(), args[2].clone(), expiry, condition, get);
    let reply = if get {
        WriteReply::Old
    } else {
        WriteReply::OkOrNil
    };
    Ok((op, reply))
}

/// `HELLO [protover [AUTH username password] [SETNAME clientname]]`.
fn parse_hello(args: &[Bytes]) -> Result<Command, Reply> {
    let mut version = None;
    let mut name = None;
    let mut user = None;
    if let Some(v) = args.get(1) {
        let v = integer(v)
            .map_err(|_| Reply::error("ERR Protocol version is not an integer or out of range"))?;
        if v != 2 && v != 3 {
            return Err(Reply::error("NOPROTO unsupported protocol version"));
        }
        version = Some(v as u8);
    }
    let mut i = 2;
    while i < args.len() {
        match args[i].to_ascii_lowercase().as_slice() {
            b"auth" if i + 2 < args.len() => {
                user = Some(args[i + 1].clone());
                i += 3;
            }
            b"setname" if i + 1 < args.len() => {
                name = Some(args[i + 1].clone());
                i += 2;
            }
            _ => {
                return Err(Reply::error(format!(
                    "ERR Syntax error in HELLO option '{}'",
                    String::from_utf8_lossy(&args[i])
                )));
            }
        }
    }
    Ok(Command::Connection(Connection::Hello {
        version,
        name,
        user,
    }))
}

/// The commands this front end knows, for `COMMAND`: name, arity (negative: at least), flags,
/// first key, last key, step, and a summary.
pub type CommandSpec = (
    &'static str,
    i64,
    &'static [&'static str],
    i64,
    i64,
    i64,
    &'static str,
);

pub const COMMANDS: &[CommandSpec] = &[
    (
        "get",
        2,
        &["readonly", "fast"],
        1,
        1,
        1,
        "Returns the value of a key.",
    ),
    (
        "mget",
        -2,
        &["readonly", "fast"],
        1,
        -1,
        1,
        "Returns the values of keys.",
    ),
    (
        "exists",
        -2,
        &["readonly", "fast"],
        1,
        -1,
        1,
        "Counts the keys that exist.",
    ),
    (
        "ttl",
        2,
        &["readonly", "fast"],
        1,
        1,
        1,
        "Returns the remaining seconds to live of a key.",
    ),
    (
        "pttl",
        2,
        &["readonly", "fast"],
        1,
        1,
        1,
        "Returns the remaining milliseconds to live of a key.",
    ),
    (
        "set",
        -3,
        &["write", "denyoom"],
        1,
        1,
        1,
        "Sets a value, with an optional condition and expiry.",
    ),
    (
        "setnx",
        3,
        &["write", "denyoom", "fast"],
        1,
        1,
        1,
        "Sets a value only if the key does not exist.",
    ),
    (
        "setex",
        4,
        &["write", "denyoom"],
        1,
        1,
        1,
        "Sets a value that expires after seconds.",
    ),
    (
        "psetex",
        4,
        &["write", "denyoom"],
        1,
        1,
        1,
        "Sets a value that expires after milliseconds.",
    ),
    (
        "mset",
        -3,
        &["write", "denyoom"],
        1,
        -1,
        2,
        "Sets many values.",
    ),
    (
        "msetnx",
        -3,
        &["write", "denyoom"],
        1,
        -1,
        2,
        "Sets many values only if none of the keys exists (keys of one partition).",
    ),
    (
        "del",
        -2,
        &["write"],
        1,
        -1,
        1,
        "Deletes keys and counts those that existed.",
    ),
    (
        "unlink",
        -2,
        &["write", "fast"],
        1,
        -1,
        1,
        "Deletes keys and counts those that existed.",
    ),
    (
        "expire",
        -3,
        &["write", "fast"],
        1,
        1,
        1,
        "Sets a key's time to live in seconds.",
    ),
    (
        "pexpire",
        -3,
        &["write", "fast"],
        1,
        1,
        1,
        "Sets a key's time to live in milliseconds.",
    ),
    (
        "expireat",
        -3,
        &["write", "fast"],
        1,
        1,
        1,
        "Sets a key's expiry as a Unix time in seconds.",
    ),
    (
        "pexpireat",
        -3,
        &["write", "fast"],
        1,
        1,
        1,
        "Sets a key's expiry as a Unix time in milliseconds.",
    ),
    (
        "persist",
        2,
        &["write", "fast"],
        1,
        1,
        1,
        "Removes a key's expiry.",
    ),
    (
        "ping",
        -1,
        &["fast"],
        0,
        0,
        0,
        "Returns PONG, or the argument.",
    ),
    ("echo", 2, &["fast"], 0, 0, 0, "Returns the argument."),
    (
        "hello",
        -1,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        0,
        0,
        0,
        "Chooses the protocol version and names the connection.",
    ),
    (
        "select",
        2,
        &["loading", "stale", "fast"],
        0,
        0,
        0,
        "Selects database 0, the only one.",
    ),
    (
        "client",
        -2,
        &["loading", "stale"],
        0,
        0,
        0,
        "Names the connection, and tells its name and id.",
    ),
    (
        "command",
        -1,
        &["loading", "stale"],
        0,
        0,
        0,
        "Describes the commands.",
    ),
    (
        "info",
        -1,
        &["loading", "stale"],
        0,
        0,
        0,
        "Describes the server.",
    ),
    (
        "config",
        -2,
        &["admin", "loading", "stale"],
        0,
        0,
        0,
        "CONFIG GET names no setting: Cairn is configured by its own file.",
    ),
    (
        "auth",
        -2,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        0,
        0,
        0,
        "Authenticates the connection.",
    ),
    (
        "quit",
        -1,
        &["fast", "no_auth"],
        0,
        0,
        0,
        "Closes the connection.",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<Bytes> {
        line.split(' ')
            .map(|a| Bytes::copy_from_slice(a.as_bytes()))
            .collect()
    }

    /// The first operation of the write `line` parses to.
    fn first_op(line: &str) -> WriteOp {
        match parse(args(line)).1 {
            Command::Write(write) => write.ops.into_iter().next().expect("an operation"),
            other => panic!("{line:?} is no write: {other:?}"),
        }
    }

    fn refused(line: &str) -> String {
        match parse(args(line)).1 {
            Command::Refused(Reply::Error(message)) => message,
            other => panic!("{line:?} was not refused: {other:?}"),
        }
    }

    #[test]
    fn set_options_parse_as_redis_does() {
        let (_, Command::Write(write)) = parse(args("SET k v NX EX 10")) else {
            panic!()
        };
        assert_eq!(write.ops[0].condition, Condition::IfAbsent);
        assert!(matches!(
            write.ops[0].action,
            Action::Set {
                expiry: Expiry::After(10_000),
                ..
            }
        ));
        assert_eq!(write.reply, WriteReply::OkOrNil);
        assert!(!write.is_plain_set());
        let (_, Command::Write(write)) = parse(args("set k v px 5 get")) else {
            panic!()
        };
        assert!(write.ops[0].return_old);
        assert_eq!(write.reply, WriteReply::Old);
        let (_, Command::Write(write)) = parse(args("SET k v EX 5")) else {
            panic!()
        };
        assert!(write.is_plain_set());

        assert_eq!(refused("SET k v NX XX"), "ERR syntax error");
        assert_eq!(refused("SET k v EX 1 PX 1"), "ERR syntax error");
        assert_eq!(refused("SET k v KEEPTTL EX 1"), "ERR syntax error");
        assert_eq!(refused("SET k v EX"), "ERR syntax error");
        assert_eq!(
            refused("SET k v EX ten"),
            "ERR value is not an integer or out of range"
        );
        assert_eq!(
            refused("SET k v EX 0"),
            "ERR invalid expire time in 'set' command"
        );
        assert_eq!(
            refused("SETEX k -1 v"),
            "ERR invalid expire time in 'setex' command"
        );
        assert_eq!(
            refused("GET"),
            "ERR wrong number of arguments for 'get' command"
        );
        assert_eq!(
            refused("MSET a 1 b"),
            "ERR wrong number of arguments for 'mset' command"
        );
        assert!(refused("SET k v EX 999999999999").contains("Cairn's limit"));
        assert!(refused("FLUSHALL now").starts_with("ERR unknown command 'FLUSHALL'"));
    }

    /// What Redis 7's `parseExtendedStringArgumentsOrReply` takes: an option given again counts
    /// once (the last expiry wins), and every option is read before the expiry's argument.
    #[test]
    fn set_options_given_twice_count_once_and_are_read_before_their_argument() {
        let expiry_of = |line: &str| match first_op(line).action {
            Action::Set { expiry, .. } => expiry,
            other => panic!("{other:?}"),
        };
        assert_eq!(expiry_of("SET k v EX 10 EX 20"), Expiry::After(20_000));
        assert_eq!(expiry_of("SET k v KEEPTTL KEEPTTL"), Expiry::Keep);
        assert_eq!(expiry_of("SET k v NX NX GET GET"), Expiry::Never);
        assert_eq!(refused("SET k v EX abc NX XX"), "ERR syntax error");
        assert_eq!(refused("SET k v EX 10 KEEPTTL"), "ERR syntax error");
        assert_eq!(
            refused("SET k v EX 10 EX abc"),
            "ERR value is not an integer or out of range"
        );
    }

    #[test]
    fn integers_are_read_as_redis_reads_them() {
        for (text, read) in [
            ("0", Some(0)),
            ("17", Some(17)),
            ("-17", Some(-17)),
            ("9223372036854775807", Some(i64::MAX)),
            ("-9223372036854775808", Some(i64::MIN)),
            ("9223372036854775808", None),
            ("+1", None),
            ("01", None),
            ("-0", None),
            ("-", None),
            ("", None),
            (" 1", None),
            ("1 ", None),
            ("1e3", None),
        ] {
            assert_eq!(redis_integer(text.as_bytes()), read, "{text:?}");
        }
        assert_eq!(
            refused("EXPIRE k +5"),
            "ERR value is not an integer or out of range"
        );
    }

    #[test]
    fn expire_times_whose_milliseconds_overflow_are_refused_either_way() {
        for line in [
            "EXPIRE k -9223372036854775808",
            "EXPIRE k 9223372036854775807",
            "EXPIREAT k -9223372036854775808",
            "SET k v EX -9223372036854775808",
        ] {
            assert!(
                refused(line).starts_with("ERR invalid expire time in"),
                "{line}"
            );
        }
        // Milliseconds cannot overflow: a past time deletes the key.
        assert!(matches!(
            first_op("PEXPIRE k -9223372036854775808").action,
            Action::Expire {
                expiry: Expiry::At(0)
            }
        ));
    }

    #[test]
    fn expire_with_a_past_time_deletes_and_options_do_not_mix() {
        let op = first_op("EXPIRE k -5");
        assert!(matches!(
            op.action,
            Action::Expire {
                expiry: Expiry::At(0)
            }
        ));
        assert_eq!(op.condition, Condition::IfPresent);
        assert_eq!(
            refused("EXPIRE k 5 NX XX"),
            "ERR NX and XX, GT or LT options at the same time are not compatible"
        );
        assert_eq!(refused("EXPIRE k 5 SOON"), "ERR Unsupported option SOON");
        assert_eq!(
            refused("EXPIRE k 5 GT LT"),
            "ERR GT and LT options at the same time are not compatible"
        );
        let (_, Command::Write(write)) = parse(args("EXPIRE k 5 XX LT")) else {
            panic!()
        };
        assert_eq!(write.ops[0].condition, Condition::IfHasEarlierExpiry);
        assert_eq!(
            refused("SET k v EXAT 18446744073709551"),
            "ERR invalid expire time in 'set' command"
        );
    }

    #[test]
    fn hello_takes_versions_2_and_3_only() {
        assert_eq!(refused("HELLO 4"), "NOPROTO unsupported protocol version");
        assert!(matches!(
            parse(args("HELLO 3 SETNAME me")).1,
            Command::Connection(Connection::Hello {
                version: Some(3),
                name: Some(_),
                user: None
            })
        ));
    }
}
