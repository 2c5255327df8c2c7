//! Redis's inline commands: a command as a line of text, as typed into `telnet` or `nc`
//! (`PING`, `SET greeting "hello world"`). A line splits into arguments as Redis splits it: at
//! blanks, with `"double quotes"` (escapes `\n \r \t \b \a \xHH`, and a backslash before any
//! other character stands for that character) and `'single quotes'` (escape `\'`). A quote may
//! open inside an argument; a closing quote must be followed by a blank or the end of the line.

use bytes::Bytes;

/// The longest inline command, with its line end, that Redis takes (`PROTO_INLINE_MAX_SIZE`).
pub(super) const INLINE_BYTES_MAX: usize = 64 * 1024;

/// Where the argument being read is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quoting {
    None,
    Double,
    Single,
}

/// The arguments of `line` (without its line end), none if it is blank; `None` if a quote is
/// left open or a closing quote is followed by something other than a blank.
pub(super) fn split(line: &[u8]) -> Option<Vec<Bytes>> {
    let mut args = Vec::new();
    let mut at = 0;
    loop {
        while line.get(at).copied().is_some_and(is_blank) {
            at += 1;
        }
        if at == line.len() {
            return Some(args);
        }
        let mut arg = Vec::new();
        let mut quoting = Quoting::None;
        loop {
            let next = line.get(at).copied();
            match (quoting, next) {
                (Quoting::None, None) => break,
                // A word ends at these only, as in `sdssplitargs`: `\v` and `\f` are part of it.
                (Quoting::None, Some(b' ' | b'\t' | b'\n' | b'\r')) => break,
                (Quoting::None, Some(b'"')) => quoting = Quoting::Double,
                (Quoting::None, Some(b'\'')) => quoting = Quoting::Single,
                (Quoting::Double | Quoting::Single, None) => return None,
                (Quoting::Double, Some(b'\\')) if at + 1 < line.len() => {
                    match (line[at + 1], hex_byte(&line[at + 2..])) {
                        (b'x', Some(byte)) => {
                            arg.push(byte);
                            at += 2;
                        }
                        (escaped, _) => arg.push(match escaped {
                            b'n' => b'\n',
                            b'r' => b'\r',
                            b't' => b'\t',
                            b'b' => 0x08,
                            b'a' => 0x07,
                            other => other,
                        }),
                    }
                    at += 1;
                }
                (Quoting::Single, Some(b'\\')) if line.get(at + 1) == Some(&b'\'') => {
                    arg.push(b'\'');
                    at += 1;
                }
                (Quoting::Double, Some(b'"')) | (Quoting::Single, Some(b'\'')) => {
                    if line.get(at + 1).is_some_and(|&c| !is_blank(c)) {
                        return None;
                    }
                    at += 1;
                    break;
                }
                (_, Some(c)) => arg.push(c),
            }
            at += 1;
        }
        args.push(Bytes::from(arg));
    }
}

/// What C's `isspace` takes for a blank.
fn is_blank(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// The byte that the two hex digits at the start of `digits` spell, if they are there.
fn hex_byte(digits: &[u8]) -> Option<u8> {
    let digit = |c: u8| char::from(c).to_digit(16);
    match digits {
        [high, low, ..] => Some((digit(*high)? * 16 + digit(*low)?) as u8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Option<Vec<String>> {
        split(line.as_bytes()).map(|args| {
            args.iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
    }

    #[test]
    fn a_line_splits_at_blanks() {
        assert_eq!(
            args("SET  k\tv "),
            Some(vec!["SET".into(), "k".into(), "v".into()])
        );
        assert_eq!(args("   "), Some(vec![]));
        assert_eq!(args(""), Some(vec![]));
        // `\v` and `\f` are blanks between words but part of one, as in `sdssplitargs`.
        assert_eq!(
            args("ECHO a\x0bb \x0c c"),
            Some(vec!["ECHO".into(), "a\x0bb".into(), "c".into()])
        );
    }

    #[test]
    fn quotes_hold_blanks_and_escapes() {
        assert_eq!(
            args(r#"SET "hello world" 'it''s'"#),
            None,
            "a closing quote must be followed by a blank"
        );
        assert_eq!(
            args(r#"SET "a b\n\x41\"" 'it\'s' x"y z""#),
            Some(vec![
                "SET".into(),
                "a b\nA\"".into(),
                "it's".into(),
                "xy z".into()
            ])
        );
        assert_eq!(
            args(r#"SET "" ''"#),
            Some(vec!["SET".into(), "".into(), "".into()])
        );
        // Not two hex digits: the backslash stands for the `x`.
        assert_eq!(args(r#""\xg1""#), Some(vec!["xg1".into()]));
        // In single quotes, a backslash is itself unless a quote follows.
        assert_eq!(args(r"'a\nb'"), Some(vec![r"a\nb".into()]));
    }

    proptest::proptest! {
        /// Arguments without blanks, quotes or backslashes read back as they were written.
        #[test]
        fn plain_arguments_read_back(words in proptest::collection::vec("[!#-&(-\\[\\]-~]{1,12}", 0..8)) {
            let line = words.join(" ");
            let read: Vec<Bytes> = words.iter().map(|w| Bytes::from(w.clone())).collect();
            proptest::prop_assert_eq!(split(line.as_bytes()), Some(read));
        }

        /// Any argument, written in double quotes with every byte as `\xHH`, reads back as it was.
        #[test]
        fn quoted_arguments_read_back(args in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..16), 0..6)) {
            let line: Vec<u8> = args
                .iter()
                .map(|arg| {
                    let hex: String = arg.iter().map(|b| format!("\\x{b:02x}")).collect();
                    format!("\"{hex}\"")
                })
                .collect::<Vec<_>>()
                .join("  ")
                .into_bytes();
            let read: Vec<Bytes> = args.into_iter().map(Bytes::from).collect();
            proptest::prop_assert_eq!(split(&line), Some(read));
        }

        #[test]
        fn any_line_splits_or_is_refused_without_panicking(line in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = split(&line);
        }
    }

    #[test]
    fn an_open_quote_is_refused() {
        assert_eq!(args(r#"SET "k v"#), None);
        assert_eq!(args("SET 'k"), None);
        assert_eq!(args(r#"SET "k\"#), None);
    }
}
