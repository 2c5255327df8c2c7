//! How Cairn connects to NATS, shared by the log (`cairn-log`) and the metadata store
//! (`cairn-metadata`), which each hold a connection of their own.
//!
//! A connection notices a server that stopped answering within about three
//! [`PING_INTERVAL`]s, and then moves to another server of the list: the default (a ping every
//! two minutes) would leave a node writing to a dead server long after its leader's lease has
//! run out. Servers are only those given: what a server advertises of its cluster is not added,
//! so a node reaches NATS exactly the way its configuration says.

use std::time::Duration;

/// How long a first connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the connection pings its server; after two unanswered pings it reconnects.
pub const PING_INTERVAL: Duration = Duration::from_millis(500);

/// Connecting to NATS failed; `servers` is the list that was tried.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to NATS ({servers}): {source}")]
pub struct ConnectError {
    pub servers: String,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// Connects to the first of `servers` that answers (`nats://host:port` each).
pub async fn connect(servers: &[String]) -> Result<async_nats::Client, ConnectError> {
    let error = |source: Box<dyn std::error::Error + Send + Sync>| ConnectError {
        servers: servers.join(", "),
        source,
    };
    let addresses = servers
        .iter()
        .map(|url| url.parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(e.into()))?;
    let options = async_nats::ConnectOptions::new()
        .ping_interval(PING_INTERVAL)
        .ignore_discovered_servers()
        .connection_timeout(Duration::from_secs(2));
    tokio::time::timeout(CONNECT_TIMEOUT, options.connect(addresses))
        .await
        .map_err(|_| error(format!("no server answered within {CONNECT_TIMEOUT:?}").into()))?
        .map_err(|e| error(e.into()))
}

/// Whether JetStream refused a publish for its expected last sequence (a compare-and-swap that
/// lost). A single server reports it as the client's own kind; a clustered stream's refusal
/// reaches the client as another kind of failed publish that says so only in its text.
pub fn wrong_last_sequence(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(err) = source {
        if err.to_string().contains("wrong last sequence") {
            return true;
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("publish failed")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_refusal_is_found_in_the_chain_of_sources() {
        let refused = Outer(std::io::Error::other(
            "nats: wrong last sequence: 41 (code 400, error code 10071)",
        ));
        assert!(wrong_last_sequence(&refused));
        let other = Outer(std::io::Error::other("timed out"));
        assert!(!wrong_last_sequence(&other));
    }

    #[tokio::test]
    async fn a_bad_url_is_refused_with_the_list() {
        let err = connect(&["nats://".to_string()]).await.unwrap_err();
        assert!(err.to_string().contains("nats://"), "{err}");
    }
}
