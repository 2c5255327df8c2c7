//! Replies, in the protocol version a connection speaks: the same reply is a flat array or a map,
//! `$-1` or `_`, depending on whether the client said `HELLO 3`.

use bytes::{Bytes, BytesMut};
use redis_protocol::resp2::types::BytesFrame as Resp2;
use redis_protocol::resp3::types::{BytesFrame as Resp3, VerbatimStringFormat};

#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `+OK`.
    Ok,
    Simple(&'static str),
    /// An error line, with its code first (`ERR …`, `NOPROTO …`).
    Error(String),
    Int(i64),
    Bulk(Bytes),
    Nil,
    Array(Vec<Reply>),
    /// A map in RESP3, a flat array of keys and values in RESP2.
    Map(Vec<(Reply, Reply)>),
    /// Text for people (`INFO`): a verbatim string in RESP3, a bulk string in RESP2.
    Text(String),
}

impl Reply {
    pub fn error(message: impl Into<String>) -> Reply {
        Reply::Error(message.into())
    }

    pub fn bulk(text: impl Into<Bytes>) -> Reply {
        Reply::Bulk(text.into())
    }

    /// Appends the encoding of the reply to `out`.
    pub fn encode(self, resp3: bool, out: &mut BytesMut) {
        // Only frames the protocol can carry are built, so encoding cannot fail.
        if resp3 {
            self.encode_resp3(out);
        } else {
            redis_protocol::resp2::encode::extend_encode(out, &self.resp2(), false)
                .expect("encode a RESP2 reply");
        }
    }

    /// RESP3, with maps in the order of their pairs (the codec's map type has none): `HELLO`
    /// puts `server` first, as Redis does.
    fn encode_resp3(self, out: &mut BytesMut) {
        match self {
            Reply::Map(pairs) => {
                out.extend_from_slice(format!("%{}\r\n", pairs.len()).as_bytes());
                for (key, value) in pairs {
                    key.encode_resp3(out);
                    value.encode_resp3(out);
                }
            }
            Reply::Array(items) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                for item in items {
                    item.encode_resp3(out);
                }
            }
            scalar => {
                redis_protocol::resp3::encode::complete::extend_encode(out, &scalar.resp3(), false)
                    .expect("encode a RESP3 reply");
            }
        }
    }

    fn resp2(self) -> Resp2 {
        match self {
            Reply::Ok => Resp2::SimpleString(Bytes::from_static(b"OK")),
            Reply::Simple(text) => Resp2::SimpleString(Bytes::from_static(text.as_bytes())),
            Reply::Error(message) => Resp2::Error(one_line(message).into()),
            Reply::Int(n) => Resp2::Integer(n),
            Reply::Bulk(bytes) => Resp2::BulkString(bytes),
            Reply::Nil => Resp2::Null,
            Reply::Array(items) => Resp2::Array(items.into_iter().map(Reply::resp2).collect()),
            Reply::Map(pairs) => Resp2::Array(
                pairs
                    .into_iter()
                    .flat_map(|(k, v)| [k.resp2(), v.resp2()])
                    .collect(),
            ),
            Reply::Text(text) => Resp2::BulkString(Bytes::from(text)),
        }
    }

    /// A scalar reply as a RESP3 frame.
    fn resp3(self) -> Resp3 {
        match self {
            Reply::Ok => Resp3::SimpleString {
                data: Bytes::from_static(b"OK"),
                attributes: None,
            },
            Reply::Simple(text) => Resp3::SimpleString {
                data: Bytes::from_static(text.as_bytes()),
                attributes: None,
            },
            Reply::Error(message) => Resp3::SimpleError {
                data: one_line(message).into(),
                attributes: None,
            },
            Reply::Int(n) => Resp3::Number {
                data: n,
                attributes: None,
            },
            Reply::Bulk(bytes) => Resp3::BlobString {
                data: bytes,
                attributes: None,
            },
            Reply::Nil => Resp3::Null,
            Reply::Array(_) | Reply::Map(_) => {
                unreachable!("arrays and maps are written by `encode_resp3`, in order")
            }
            Reply::Text(text) => Resp3::VerbatimString {
                data: Bytes::from(text),
                format: VerbatimStringFormat::Text,
                attributes: None,
            },
        }
    }
}

/// An error line cannot hold a line break: they become spaces.
fn one_line(message: String) -> String {
    if message.contains(['\r', '\n']) {
        message.replace(['\r', '\n'], " ")
    } else {
        message
    }
}
