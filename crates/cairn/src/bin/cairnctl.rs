//! `cairnctl`, the admin CLI. Everything lives in `cairn-cli`.

fn main() -> std::process::ExitCode {
    cairn_cli::main()
}
