//! The real-model subcommands of `fathom`, built standalone from the CLI's own source
//! (`crates/fathom-cli/src/model_cmds.rs`), for development of this crate:
//! `cargo run --release -p fathom-model --example cli -- generate --prompt "The capital of France is"`.

#[path = "../../fathom-cli/src/model_cmds.rs"]
mod model_cmds;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    Generate(model_cmds::GenerateArgs),
    Capture(model_cmds::CaptureArgs),
    FetchModels(model_cmds::FetchModelsArgs),
    FetchCorpus(model_cmds::FetchCorpusArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Generate(a) => model_cmds::run_generate(a),
        Cmd::Capture(a) => model_cmds::run_capture(a),
        Cmd::FetchModels(a) => model_cmds::run_fetch_models(a),
        Cmd::FetchCorpus(a) => model_cmds::run_fetch_corpus(a),
    }
}
