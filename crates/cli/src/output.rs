//! Tables in the style the user asked for.

use crate::args::{TableStyle, TimeFormat};
use comfy_table::{ContentArrangement, Table, presets};

pub fn table(style: TableStyle, header: &[&str]) -> Table {
    let mut table = Table::new();
    match style {
        TableStyle::Compact => table.load_preset(presets::NOTHING),
        TableStyle::Borders => table.load_preset(presets::UTF8_FULL),
    };
    table
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().copied());
    table
}

/// An RFC 3339 time from the server in the format the user asked for.
pub fn show_time(rfc3339: &str, format: TimeFormat) -> String {
    let Ok(time) = chrono::DateTime::parse_from_rfc3339(rfc3339) else {
        return rfc3339.to_string();
    };
    match format {
        TimeFormat::Iso8601 => time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        TimeFormat::Rfc2822 => time.to_rfc2822(),
        TimeFormat::Human => {
            let age = chrono::Utc::now().signed_duration_since(time);
            let secs = age.num_seconds().max(0) as u64;
            match secs {
                0..60 => format!("{secs}s ago"),
                60..3600 => format!("{}m ago", secs / 60),
                3600..86400 => format!("{}h ago", secs / 3600),
                _ => format!("{}d ago", secs / 86400),
            }
        }
    }
}

/// A byte count in binary units.
pub fn show_bytes_count(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A key or value as text: UTF-8 as is, anything else as hex.
pub fn show_bytes(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if !text.chars().any(char::is_control) => text.to_string(),
        _ => format!(
            "0x{}",
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_sizes_read_well() {
        let t = "2024-09-26T07:31:49.264Z";
        assert_eq!(
            show_time(t, TimeFormat::Rfc2822),
            "Thu, 26 Sep 2024 07:31:49 +0000"
        );
        assert_eq!(
            show_time(t, TimeFormat::Iso8601),
            "2024-09-26T07:31:49.264Z"
        );
        assert!(show_time(t, TimeFormat::Human).ends_with("d ago"));
        assert_eq!(show_bytes_count(1267), "1.2 KiB");
        assert_eq!(show_bytes_count(12), "12 B");
    }

    #[test]
    fn binary_values_show_as_hex() {
        assert_eq!(show_bytes(b"hello"), "hello");
        assert_eq!(show_bytes(&[0, 255]), "0x00ff");
    }
}
