use clap::Parser;

fn main() -> std::process::ExitCode {
    nightshift::cli::Cli::parse().run()
}
