use clap::Parser;

// Many small, short-lived allocations on several threads (one request, one record per
// line): mimalloc handles them with less contention than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    nightshift::cli::Cli::parse().run()
}
