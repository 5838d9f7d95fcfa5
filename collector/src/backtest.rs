//! `headroom-collector backtest`: replay one trace through the rules, score
//! them on a labelled directory of traces, or write the built-in labelled
//! corpus (rules/src/score.rs, rules/src/corpus.rs).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{ArgGroup, Args};
use headroom_rules::config::RulesConfig;
use headroom_rules::corpus;

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("mode").required(true).args(["trace", "score", "write_corpus", "evaluate", "write_generated"])))]
pub struct BacktestArgs {
    /// Rules file (TOML); built-in defaults without one.
    #[arg(long, conflicts_with = "write_corpus")]
    rules: Option<PathBuf>,
    /// Trace: `timestamp_ms,node,gpu,pid,used_bytes,total_bytes` with a
    /// header. Prints the alerts, one JSON object per line.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Score the rules, and the Prometheus `predict_linear` baseline, on the
    /// traces named in DIR/labels.json. Prints a scorecard.
    #[arg(long, value_name = "DIR")]
    score: Option<PathBuf>,
    /// The scorecard as JSON.
    #[arg(long, conflicts_with_all = ["trace", "write_corpus", "write_generated"])]
    json: bool,
    /// Write the built-in labelled corpus (traces and labels.json) into DIR.
    #[arg(long, value_name = "DIR")]
    write_corpus: Option<PathBuf>,
    /// Score the rules leave-one-family-out on the generated corpus
    /// (rules/src/families.rs), beside `predict_linear`.
    #[arg(long)]
    evaluate: bool,
    /// Write the generated corpus (traces and labels.json) into DIR, to
    /// score with --score or with another tool.
    #[arg(long, value_name = "DIR")]
    write_generated: Option<PathBuf>,
    /// Generated traces per family.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1000))]
    per_family: u64,
    /// Seed of the generated corpus: the same seed draws the same traces.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(args: BacktestArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.write_corpus {
        return write_corpus(dir);
    }
    if let Some(dir) = &args.write_generated {
        return write_generated(dir, args.per_family, args.seed);
    }
    let rules = crate::load_rules(args.rules.as_deref())?;
    if args.evaluate {
        let evaluation = headroom_rules::evaluate::evaluate(&rules, args.per_family, args.seed);
        if args.json {
            println!("{}", serde_json::to_string_pretty(&evaluation)?);
        } else {
            print!("{evaluation}");
        }
        return Ok(());
    }
    match (&args.trace, &args.score) {
        (Some(trace), _) => replay(rules, trace),
        (None, Some(dir)) => score(&rules, dir, args.json),
        (None, None) => anyhow::bail!("give --trace FILE, --score DIR or --write-corpus DIR"),
    }
}

fn replay(rules: RulesConfig, trace: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::open(trace)
        .with_context(|| format!("cannot open trace {}", trace.display()))?;
    let (alerts, errors) = headroom_rules::backtest::run(rules, std::io::BufReader::new(file));
    for alert in &alerts {
        println!("{}", serde_json::to_string(alert)?);
    }
    for error in &errors {
        eprintln!("{}: {error}", trace.display());
    }
    if !errors.is_empty() {
        anyhow::bail!(
            "{} bad line(s) in {} were skipped",
            errors.len(),
            trace.display()
        );
    }
    Ok(())
}

fn score(rules: &RulesConfig, dir: &Path, json: bool) -> anyhow::Result<()> {
    let scorecard = headroom_rules::score::score_dir(rules, dir)
        .with_context(|| format!("cannot score the traces in {}", dir.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&scorecard)?);
    } else {
        print!("{scorecard}");
    }
    // Misses and false alarms are the scorecard's news, not failures; lines
    // the traces could not be read by are, as they are for --trace.
    let skipped: usize = scorecard.traces.iter().map(|t| t.errors.len()).sum();
    if skipped > 0 {
        anyhow::bail!(
            "{skipped} bad line(s) in the traces of {} were skipped",
            dir.display()
        );
    }
    Ok(())
}

fn write_generated(dir: &Path, per_family: u64, seed: u64) -> anyhow::Result<()> {
    let traces: Vec<_> = headroom_rules::generator::generate(per_family, seed)
        .into_iter()
        .map(|g| g.trace)
        .collect();
    corpus::write_traces(dir, &traces)
        .with_context(|| format!("cannot write the generated corpus into {}", dir.display()))?;
    eprintln!(
        "wrote {} generated traces and {} into {}",
        traces.len(),
        corpus::LABELS_FILE,
        dir.display()
    );
    Ok(())
}

fn write_corpus(dir: &Path) -> anyhow::Result<()> {
    let traces = corpus::corpus();
    corpus::write_traces(dir, &traces)
        .with_context(|| format!("cannot write the corpus into {}", dir.display()))?;
    eprintln!(
        "wrote {} traces and {} into {}",
        traces.len(),
        corpus::LABELS_FILE,
        dir.display()
    );
    Ok(())
}
