//! The pipeline's stages: `fathom` command lines run in order under a time budget, each
//! logged as a `fathom-results` stage record; a capture whose `.cmd` sidecar matches is reused.

use super::*;

/// One stage: a `fathom` command line, its name and a rough duration estimate (s).
pub(crate) struct Stage {
    pub(crate) name: String,
    pub(crate) args: Vec<String>,
    pub(crate) estimate: f64,
}

pub(crate) fn stage(name: &str, estimate: f64, args: &[&str]) -> Stage {
    Stage {
        name: name.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        estimate,
    }
}

/// A stage from one command line (arguments split on whitespace; none of the pipeline's
/// arguments contain spaces).
pub(crate) fn stage_cmd(name: &str, estimate: f64, cmd: &str) -> Stage {
    Stage {
        name: name.into(),
        args: cmd.split_whitespace().map(String::from).collect(),
        estimate,
    }
}

/// The files a stage reads that an earlier stage writes (`--capture X`, `--calib X`).
pub(crate) fn stage_inputs(args: &[String]) -> Vec<PathBuf> {
    args.windows(2)
        .filter(|w| w[0] == "--capture" || w[0] == "--calib")
        .map(|w| root().join(&w[1]))
        .collect()
}

/// The output of a `capture` stage, whose sidecar `OUT.cmd` records the command that wrote
/// it: a rerun with the same command reuses the file.
pub(crate) fn capture_output(args: &[String]) -> Option<PathBuf> {
    if args.first().map(String::as_str) != Some("capture") {
        return None;
    }
    args.windows(2)
        .find(|w| w[0] == "--out")
        .map(|w| root().join(&w[1]))
}

pub(crate) fn sidecar(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".cmd");
    PathBuf::from(s)
}

/// Runs every stage; a failing stage is logged and the rest continue. With a `budget`
/// (seconds), a stage whose estimate would overrun it is skipped and logged as such; a stage
/// whose input an earlier stage did not produce is skipped too. Skips are not failures.
pub(crate) fn run_stages(
    bin: &Path,
    stages: &[Stage],
    log: &Path,
    budget: Option<f64>,
) -> Result<bool> {
    let mut f =
        std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let total: f64 = stages.iter().map(|s| s.estimate).sum();
    let t0 = Instant::now();
    let mut done_est = 0.0;
    let mut all_ok = true;
    for (i, s) in stages.iter().enumerate() {
        let el = t0.elapsed().as_secs_f64();
        let eta = if done_est > 0.0 {
            (total - done_est) * el / done_est
        } else {
            total
        };
        let cmd = format!("fathom {}", s.args.join(" "));
        let log_line = |f: &mut std::fs::File, ok: bool, secs: f64, err: &str, skipped: &str| {
            let rec = StageRecord {
                version: fathom_results::VERSION,
                stage: s.name.clone(),
                ok,
                seconds: (secs * 100.0).round() / 100.0,
                command: cmd.clone(),
                error: err.into(),
                skipped: skipped.into(),
            };
            writeln!(f, "{}", rec.to_line())
        };
        done_est += s.estimate;
        // A stage is skipped (not failed) when it would overrun the budget or an earlier
        // stage did not produce its input.
        let skip = match (
            budget,
            stage_inputs(&s.args).into_iter().find(|p| !p.exists()),
        ) {
            (Some(b), _) if el + s.estimate > b => Some(format!(
                "time budget: {:.0} s used, this stage's estimate is {:.0} s, the budget {:.0} s",
                el, s.estimate, b
            )),
            (_, Some(missing)) => Some(format!(
                "input {} is missing (the stage that writes it was skipped or failed)",
                missing.display()
            )),
            _ => None,
        };
        if let Some(why) = skip {
            eprintln!(
                "xtask: [{}/{}] {} SKIPPED ({why})",
                i + 1,
                stages.len(),
                s.name
            );
            log_line(&mut f, true, 0.0, "", &why)?;
            continue;
        }
        if let Some(out) = capture_output(&s.args) {
            let same = std::fs::read_to_string(sidecar(&out)).is_ok_and(|c| c.trim() == cmd);
            if same && out.exists() {
                eprintln!(
                    "xtask: [{}/{}] {} — reusing {} (written by the same command)",
                    i + 1,
                    stages.len(),
                    s.name,
                    out.display()
                );
                log_line(
                    &mut f,
                    true,
                    0.0,
                    "",
                    "cached: the same command wrote this capture before",
                )?;
                continue;
            }
        }
        eprintln!(
            "xtask: [{}/{}] {} — elapsed {:.0}s, ETA ~{:.0}s\n        {cmd}",
            i + 1,
            stages.len(),
            s.name,
            el,
            eta,
        );
        let ts = Instant::now();
        let out = Command::new(bin).args(&s.args).current_dir(root()).status();
        let secs = ts.elapsed().as_secs_f64();
        let (ok, err) = match out {
            Ok(st) if st.success() => (true, String::new()),
            Ok(st) => (false, format!("exit status {st}")),
            Err(e) => (false, e.to_string()),
        };
        if !ok {
            eprintln!("xtask: stage {} FAILED ({err}); continuing", s.name);
            all_ok = false;
        } else if let Some(out) = capture_output(&s.args) {
            std::fs::write(sidecar(&out), &cmd)
                .with_context(|| format!("writing {}", sidecar(&out).display()))?;
        }
        log_line(&mut f, ok, secs, &err, "")?;
    }
    eprintln!(
        "xtask: all stages done in {:.0}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(all_ok)
}
