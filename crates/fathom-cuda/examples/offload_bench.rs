//! `fathom offload-bench` as a standalone binary (the same code as the CLI subcommand):
//!
//! ```text
//! cargo build --release -p fathom-cuda --features cuda --example offload_bench
//! target/release/examples/offload_bench --shape qwen3-8b --context 32k,256k,1m --json out.json
//! ```

#[path = "../../fathom-cli/src/offload_cmds.rs"]
mod offload_cmds;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Fathom offload decode-step benchmark (docs/SPEC.md §6)")]
struct Cli {
    #[command(flatten)]
    args: offload_cmds::OffloadBenchArgs,
}

fn main() -> anyhow::Result<()> {
    offload_cmds::run_offload_bench(Cli::parse().args)
}
