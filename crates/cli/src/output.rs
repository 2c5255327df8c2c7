//! Tables in the style the user asked for.

use crate::args::TableStyle;
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
    fn binary_values_show_as_hex() {
        assert_eq!(show_bytes(b"hello"), "hello");
        assert_eq!(show_bytes(&[0, 255]), "0x00ff");
    }
}
