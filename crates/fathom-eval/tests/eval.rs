//! Generators, scoring and branched decoding on tiny contexts. Model tests read the model from
//! the local cache only; when it is absent they print why and return.

use std::sync::OnceLock;

use fathom_baselines::{Dense, Exact, Loki, SparQ};
use fathom_bench::decode::RowCacheTally;
use fathom_eval::agent::{self, agreement, session, AgentPlan};
use fathom_eval::decode::{calibrate, decode_branch, forced_branch, Prefill};
use fathom_eval::ruler::{self, generate, needle, score, Haystack, RulerPlan, Task, TaskParams};
use fathom_eval::runner::{Batched, BatchedBackend, BoxError, Branching, Progress};
use fathom_eval::words::WordList;
use fathom_model::corpus::{CorpusOptions, Document};
use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::pypi::skip_missing_data;
use fathom_model::{generate_greedy, LoadOptions, Model};
use fathom_plan::scanner::{Fathom, Scanner};
use fathom_plan::SelectParams;

fn model() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let opts = FetchOptions {
            offline: true,
            ..Default::default()
        };
        match fetch_model(ModelId::Smollm2_135m, &opts) {
            Ok(p) => Some(Model::load(&p, &LoadOptions::default()).expect("model loads")),
            Err(e) => {
                skip_missing_data(&format!(
                    "smollm2-135m is not in the cache ({e}); run `fathom fetch-models`"
                ));
                None
            }
        }
    })
    .as_ref()
}

/// Real English prose for tiny haystacks: the workspace's own documentation.
const TEXTS: [&str; 4] = [
    include_str!("../../../README.md"),
    include_str!("../../../ARCHITECTURE.md"),
    include_str!("../../fathom-store/README.md"),
    include_str!("../../fathom-plan/README.md"),
];

fn haystack() -> Haystack {
    Haystack::new(TEXTS.iter().copied(), "workspace docs").expect("haystack")
}

/// The pinned RULER word list from the local cache (`fathom fetch-corpus` puts it there).
fn words() -> Option<WordList> {
    let opts = CorpusOptions {
        offline: true,
        ..Default::default()
    };
    match WordList::fetch(&opts) {
        Ok(w) => Some(w),
        Err(e) => {
            skip_missing_data(&format!(
                "the RULER word list is not in the cache ({e}); run `fathom fetch-corpus`"
            ));
            None
        }
    }
}

fn params(context: usize) -> TaskParams {
    TaskParams {
        context,
        tokens_to_generate: None,
        seed: 42,
        format: fathom_eval::ruler::PromptFormat::Ruler,
        shape: fathom_eval::ruler::TaskShape::RULER,
        vt_example: true,
        vt_noise: true,
        niah_noise: false,
    }
}

/// `--haystack noise`: every NIAH task plants its needles between lines of RULER's noise
/// (offset 0, every needle present, the same gold and question as on the real text), within
/// the context.
#[test]
fn niah_tasks_read_rulers_noise_when_asked() {
    use fathom_eval::ruler::{TaskShape, VT_NOISE};
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    for task in [
        Task::NiahSingle,
        Task::NiahMultikey,
        Task::NiahMultivalue,
        Task::NiahMultiquery,
    ] {
        for i in 0..2 {
            let mut p = params(2048);
            p.shape = TaskShape::SMALL;
            let text = generate(task, &p, m.tokenizer(), &h, &w, i).expect("text");
            p.niah_noise = true;
            let noise = generate(task, &p, m.tokenizer(), &h, &w, i).expect("noise");
            assert_eq!((&noise.gold, &noise.question), (&text.gold, &text.question));
            assert!(noise.prompt_tokens + noise.max_new <= 2048);
            assert_eq!(noise.haystack_offset, 0);
            let lines = noise.prompt.matches(VT_NOISE.trim_end()).count();
            assert!(
                lines >= noise.haystack_words && lines > 4,
                "{task:?} {i}: {lines}"
            );
            assert_eq!(text.prompt.matches(VT_NOISE.trim_end()).count(), 0);
            for g in &noise.gold {
                assert!(
                    noise.prompt.contains(g.as_str()),
                    "{task:?} {i}: {g} planted"
                );
            }
        }
    }
}

/// `vt` reads RULER's haystack, its line of noise repeated, with the chain's statements
/// between lines (its in-context example too); `vt_noise = false` reads the real-text
/// haystack instead, and the chain, gold and question are the same either way.
#[test]
fn vt_reads_rulers_noise_haystack_unless_told_otherwise() {
    use fathom_eval::ruler::{TaskShape, VT_NOISE};
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    for (context, shape) in [(1024, TaskShape::SMALL), (2048, TaskShape::RULER)] {
        for i in 0..3 {
            let mut p = params(context);
            p.shape = shape;
            let noise = generate(Task::Vt, &p, m.tokenizer(), &h, &w, i).expect("vt");
            p.vt_noise = false;
            let text = generate(Task::Vt, &p, m.tokenizer(), &h, &w, i).expect("vt");
            assert_eq!((&noise.gold, &noise.question), (&text.gold, &text.question));
            assert!(noise.prompt_tokens + noise.max_new <= context);
            assert_eq!(noise.haystack_offset, 0);
            let lines = noise.prompt.matches(VT_NOISE.trim_end()).count();
            assert!(
                lines >= noise.haystack_words,
                "{lines} < {}",
                noise.haystack_words
            );
            assert!(
                noise.haystack_words > 4,
                "{context} {i}: {}",
                noise.haystack_words
            );
            assert_eq!(text.prompt.matches(VT_NOISE.trim_end()).count(), 0);
            // Every statement of the chain is there, in order, on the noise side too.
            let first = noise.prompt.rfind("Memorize and track").unwrap();
            let task = &noise.prompt[first..];
            let mut at = 0;
            for (hop, name) in noise.gold.iter().enumerate() {
                let needle = if hop == 0 {
                    format!("VAR {name} = ")
                } else {
                    format!("VAR {name} = VAR {}", noise.gold[hop - 1])
                };
                let found = task[at..].find(&needle).expect("a statement of the chain");
                at += found;
            }
            assert!(
                text.haystack_words > noise.haystack_words,
                "words, not lines"
            );
        }
    }
}

/// `vt` opens with RULER's in-context example: the same template and answer prefix over a
/// short text, a chain of 3-letter names, and its answer; the task after it is the prompt
/// without the example but for a shorter haystack (the example draws from its own stream).
#[test]
fn vt_opens_with_its_in_context_example_and_keeps_the_task() {
    use fathom_eval::ruler::{TaskShape, VT_EXAMPLE_TOKENS};
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    for (context, shape, chain) in [
        (1024, TaskShape::SMALL, 2),
        (2048, TaskShape::RULER, 5),
        (4096, TaskShape::parse("chain=1").unwrap(), 1),
    ] {
        for i in 0..3 {
            let mut p = params(context);
            p.shape = shape;
            let with = generate(Task::Vt, &p, m.tokenizer(), &h, &w, i).expect("vt");
            p.vt_example = false;
            let without = generate(Task::Vt, &p, m.tokenizer(), &h, &w, i).expect("vt");
            assert_eq!(without.example_tokens, 0);
            assert_eq!(
                (&with.gold, &with.question),
                (&without.gold, &without.question)
            );
            assert!(with.prompt_tokens + with.max_new <= context);
            assert!(with.example_tokens > 0 && with.example_tokens <= VT_EXAMPLE_TOKENS - 30);
            assert!(with.haystack_words < without.haystack_words);
            // Two templates, two answer prefixes; the example's ends with its names.
            let heads = "Memorize and track the chain(s) of variable assignment";
            assert_eq!(with.prompt.matches(heads).count(), 2, "{context} {i}");
            assert_eq!(without.prompt.matches(heads).count(), 1);
            let (example, task) = with.prompt.split_at(with.prompt.rfind(heads).unwrap());
            let names: Vec<&str> = example
                .rsplit_once("they are: ")
                .expect("the example's answer prefix")
                .1
                .split_whitespace()
                .collect();
            assert_eq!(names.len(), chain, "{context} {i}: {names:?}");
            assert!(names
                .iter()
                .all(|n| n.len() == 3 && n.chars().all(|c| c.is_ascii_uppercase())));
            assert!(example.contains(&format!("VAR {} = ", names[0])));
            for hop in 1..chain {
                let a = example.find(&format!("VAR {} = VAR {}", names[hop], names[hop - 1]));
                assert!(a.is_some(), "example hop {hop}");
            }
            // The task's chain is in the task's part only, and the task's text is the
            // example-free prompt's up to the haystack's length.
            assert!(task.contains(&format!("VAR {} = ", with.gold[0])));
            assert!(!example.contains(&with.gold[0]));
            let tail = |s: &str| s.rsplit_once("\nQuestion:").map(|x| x.1.to_string());
            assert_eq!(tail(task), tail(&without.prompt));
        }
    }
}

/// `answer=lines` changes only the answer prefix of the tasks of several gold values: it
/// ends with the first line of a list worded as the needle, naming no value; every other
/// task's prompt, and every task's gold, needles and question, stay as they were.
#[test]
fn needle_lines_end_only_the_answer_prefix_of_several_values() {
    use fathom_eval::ruler::{AnswerForm, TaskShape};
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    for (context, base) in [
        (1024, "small,needle=passkey"),
        (2048, "small"),
        (4096, "ruler,needle=passkey"),
    ] {
        let plain = TaskShape::parse(base).unwrap();
        let lines = TaskShape::parse(&format!("{base},answer=lines")).unwrap();
        assert_eq!(lines.answer, AnswerForm::Lines);
        assert_ne!(plain.label(), lines.label());
        for task in Task::ALL {
            for i in 0..2 {
                let mut p = params(context);
                p.shape = plain;
                let a = generate(task, &p, m.tokenizer(), &h, &w, i).expect("plain");
                p.shape = lines;
                let b = generate(task, &p, m.tokenizer(), &h, &w, i).expect("lines");
                assert_eq!(
                    (&a.gold, &a.question, &a.depths),
                    (&b.gold, &b.question, &b.depths)
                );
                assert!(b.prompt_tokens + b.max_new <= context, "{task:?} {context}");
                let several =
                    matches!(task, Task::NiahMultivalue | Task::NiahMultiquery) && a.gold.len() > 1;
                if !several {
                    assert_eq!(a.prompt, b.prompt, "{task:?} {context} {i}");
                    continue;
                }
                let (_, last) = b
                    .prompt
                    .rsplit_once(":\n- ")
                    .expect("the list's first line");
                let lead = if base.contains("passkey") {
                    "The pass key for "
                } else {
                    "One of the special magic numbers for "
                };
                assert!(last.starts_with(lead), "{last:?}");
                assert!(
                    a.gold.iter().all(|g| !last.contains(g.as_str())),
                    "{last:?}"
                );
                // The haystack may be shorter by the prefix's few tokens, never longer.
                assert!(b.haystack_words <= a.haystack_words);
            }
        }
    }
    let e = TaskShape::parse("small,answer=list")
        .unwrap_err()
        .to_string();
    assert!(e.contains("answer=list"), "{e}");
}

/// The small task shape plants 2 keys, 2 values and a chain of 2, keeps RULER's structure
/// (the needle sentence, the question, the answer prefix with the chain's length) and fits.
#[test]
fn the_small_task_shape_plants_fewer_needles_in_the_same_templates() {
    use fathom_eval::ruler::TaskShape;
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    let mut p = params(1024);
    p.shape = TaskShape::SMALL;
    for i in 0..3 {
        for (task, gold, needles) in [
            (Task::NiahSingle, 1, 1),
            (Task::NiahMultikey, 1, 2),
            (Task::NiahMultivalue, 2, 2),
            (Task::NiahMultiquery, 2, 2),
            (Task::Vt, 2, 0),
        ] {
            let s = generate(task, &p, m.tokenizer(), &h, &w, i).expect("generate");
            assert_eq!(s.gold.len(), gold, "{task:?}");
            assert!(s.prompt_tokens + s.max_new <= 1024, "{task:?}");
            if needles > 0 {
                assert_eq!(
                    s.prompt
                        .matches("One of the special magic numbers for")
                        .count(),
                    needles,
                    "{task:?}"
                );
                for g in &s.gold {
                    assert!(s.prompt.contains(&format!(": {g}.")), "{task:?}: {g}");
                }
            } else {
                assert!(
                    s.prompt.contains("2 variables are assgined"),
                    "vt answer prefix"
                );
                // One value and one hop in the task, and as many in its in-context example.
                assert_eq!(
                    s.prompt.matches("VAR ").count(),
                    6,
                    "vt: one value, one hop, twice"
                );
            }
        }
    }
    assert_eq!(TaskShape::parse("small").unwrap(), TaskShape::SMALL);
    assert_eq!(TaskShape::parse("ruler").unwrap().label(), "ruler");
    assert!(TaskShape::parse("tiny").is_err());
    let t = TaskShape::parse("small,digits=4,keys=3").unwrap();
    assert_eq!((t.keys, t.values, t.chain, t.digits), (3, 2, 2, 4));
    let t = TaskShape::parse("chain=1").unwrap();
    assert_eq!((t.keys, t.values, t.chain, t.digits), (4, 4, 1, 7));
    assert!(t.label().contains("chain 1"));
    for bad in [
        "small,digits=0",
        "keys=17",
        "small,nope=2",
        "small,keys",
        "small,keys=x",
        "tiny,keys=2",
    ] {
        let e = TaskShape::parse(bad).unwrap_err().to_string();
        assert!(e.contains(bad), "{bad}: {e}");
    }
    assert!(TaskShape::SMALL.label().contains("keys 2"));
}

#[test]
fn generators_are_deterministic_and_fit() {
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    for task in Task::ALL {
        let a = generate(task, &params(1024), m.tokenizer(), &h, &w, 3).expect("generate");
        let b = generate(task, &params(1024), m.tokenizer(), &h, &w, 3).expect("generate");
        assert_eq!(a.prompt, b.prompt, "{task:?}");
        assert_eq!(a.gold, b.gold, "{task:?}");
        assert!(
            a.prompt_tokens + a.max_new <= 1024,
            "{task:?}: {} + {}",
            a.prompt_tokens,
            a.max_new
        );
        assert!(
            a.prompt_tokens + a.max_new > 900,
            "{task:?}: haystack too small ({})",
            a.prompt_tokens
        );
        let c = generate(task, &params(1024), m.tokenizer(), &h, &w, 4).expect("generate");
        assert_ne!(
            a.prompt, c.prompt,
            "{task:?}: another index gives another sample"
        );
        let mut p = params(1024);
        p.seed = 43;
        let d = generate(task, &p, m.tokenizer(), &h, &w, 3).expect("generate");
        assert_ne!(
            a.prompt, d.prompt,
            "{task:?}: another seed gives another sample"
        );
    }
}

#[test]
fn planted_needles_are_in_the_prompt() {
    let Some(m) = model() else { return };
    let Some(w) = words() else { return };
    let h = haystack();
    for i in 0..3 {
        for task in [
            Task::NiahSingle,
            Task::NiahMultikey,
            Task::NiahMultivalue,
            Task::NiahMultiquery,
        ] {
            let s = generate(task, &params(1024), m.tokenizer(), &h, &w, i).expect("generate");
            let n_gold = if matches!(task, Task::NiahSingle | Task::NiahMultikey) {
                1
            } else {
                4
            };
            assert_eq!(s.gold.len(), n_gold, "{task:?}");
            let n_needles = if task == Task::NiahSingle { 1 } else { 4 };
            assert_eq!(
                s.prompt
                    .matches("One of the special magic numbers for")
                    .count(),
                n_needles,
                "{task:?}"
            );
            let query = s
                .question
                .split("numbers for ")
                .nth(1)
                .and_then(|q| q.split(" mentioned").next())
                .expect("query");
            let keys: Vec<&str> = query.split(", and ").flat_map(|x| x.split(", ")).collect();
            for v in &s.gold {
                assert_eq!(v.len(), 7, "7-digit values");
                assert!(
                    keys.iter().any(|k| s.prompt.contains(&needle(k, v))),
                    "{task:?}: needle for {v} not found by string search"
                );
            }
            assert!(s.prompt.ends_with(&format!(
                " The special magic numbers for {query} mentioned in the provided text are"
            )));
        }
        let s = generate(Task::Vt, &params(1024), m.tokenizer(), &h, &w, i).expect("vt");
        let value = s
            .question
            .split("assigned the value ")
            .nth(1)
            .and_then(|q| q.split(' ').next())
            .expect("value");
        let mut at = s
            .prompt
            .find(&format!("VAR {} = {value}", s.gold[0]))
            .expect("chain head");
        for hop in 1..5 {
            let stmt = format!("VAR {} = VAR {}", s.gold[hop], s.gold[hop - 1]);
            let j = s.prompt.find(&stmt).expect("hop");
            assert!(j > at, "hops are in order");
            at = j;
        }
        let s = generate(Task::Fwe, &params(1024), m.tokenizer(), &h, &w, i).expect("fwe");
        let body = s
            .prompt
            .split("coded words. ")
            .nth(1)
            .and_then(|b| b.split("\nQuestion:").next())
            .expect("body");
        let mut counts = std::collections::HashMap::<&str, usize>::new();
        for t in body.split_whitespace() {
            *counts.entry(t).or_default() += 1;
        }
        let mut ranked: Vec<(&str, usize)> =
            counts.into_iter().filter(|(w, _)| *w != "...").collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let top: Vec<usize> = s
            .gold
            .iter()
            .map(|g| {
                ranked
                    .iter()
                    .find(|r| r.0 == g)
                    .expect("gold word present")
                    .1
            })
            .collect();
        assert!(top[0] >= top[1] && top[1] >= top[2], "{top:?}");
        assert!(
            ranked.len() > 3 && top[2] > ranked[3].1,
            "the three gold words are the most frequent"
        );
    }
}

#[test]
fn scoring_on_hand_made_generations() {
    let g = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let check = |gen: &str, gold: &[&str], want: f64| {
        assert_eq!(score(gen, &g(gold)), want, "{gen:?} against {gold:?}");
    };
    check(" 1234567.", &["1234567"], 1.0);
    check(" 123456.", &["1234567"], 0.0);
    check(
        " 1234567, 7654321 and 1111111",
        &["1234567", "7654321", "2222222", "1111111"],
        0.75,
    );
    check(
        " they are: abcde, FGHIJ",
        &["ABCDE", "fghij", "KLMNO", "PQRST", "UVWXY"],
        0.4,
    );
    check("", &["x"], 0.0);
    check("anything", &[], 0.0);
    assert_eq!(agreement(&[1, 2, 3, 4], &[1, 2, 0, 4]), 0.75);
}

fn prompt(m: &Model, words: usize) -> Vec<u32> {
    let text: Vec<&str> = TEXTS
        .iter()
        .flat_map(|t| t.split_whitespace())
        .take(words)
        .collect();
    m.tokenizer().encode(&text.join(" ")).expect("encode")
}

#[test]
fn dense_branch_reproduces_plain_greedy() {
    let Some(m) = model() else { return };
    let ids = prompt(m, 300);
    let want = generate_greedy(
        m,
        &ids,
        24,
        fathom_eval::decode::PREFILL_CHUNK,
        &mut fathom_model::Dense,
    )
    .expect("greedy");
    let pre = Prefill::new(m, &ids, 24, None, false).expect("prefill");
    let got = decode_branch(m, &pre, &Dense, None, SelectParams::default(), 24, &|_| {
        false
    })
    .expect("branch");
    assert_eq!(got.tokens, want);
}

#[test]
fn branching_leaves_the_prefill_unchanged_and_exact_with_room_matches_dense() {
    let Some(m) = model() else { return };
    let ids = prompt(m, 400);
    let cal_ids = prompt(m, 250);
    let calib = calibrate(m, &cal_ids, 32).expect("calibrate");
    let pre = Prefill::new(m, &ids, 16, Some(&calib), true).expect("prefill");
    let snapshot = pre.clone();
    let small = SelectParams {
        sink: 4,
        local: 32,
        k: 16,
    };
    let methods: Vec<Box<dyn Scanner>> = vec![
        Box::new(Exact),
        Box::new(Fathom::new(48.0)),
        Box::new(SparQ { r: 16 }),
        Box::new(Loki { r: 32 }),
    ];
    for meth in &methods {
        let b = decode_branch(m, &pre, meth.as_ref(), Some(&calib), small, 16, &|_| false)
            .expect("branch");
        assert_eq!(b.tokens.len(), 16);
        assert!(
            b.stats.scans > 0 && b.stats.density() < 0.5,
            "{}: density {}",
            meth.name(),
            b.stats.density()
        );
        let f =
            forced_branch(m, &pre, meth.as_ref(), Some(&calib), small, &b.tokens).expect("forced");
        assert_eq!(
            f.tokens[..15],
            b.tokens[1..],
            "{}: teacher forcing its own output reproduces it",
            meth.name()
        );
    }
    assert_eq!(pre.cache.len(), snapshot.cache.len());
    assert_eq!(pre.logits, snapshot.logits);
    for l in 0..m.config().n_layers {
        assert_eq!(
            pre.cache.keys(l).data,
            snapshot.cache.keys(l).data,
            "layer {l} keys"
        );
        assert_eq!(
            pre.cache.values(l).data,
            snapshot.cache.values(l).data,
            "layer {l} values"
        );
    }
    // With k covering the whole middle, exact top-k attends to every key: same tokens as dense.
    let all = SelectParams {
        sink: 4,
        local: 32,
        k: 100_000,
    };
    let e = decode_branch(m, &pre, &Exact, None, all, 16, &|_| false).expect("exact");
    let d = decode_branch(m, &pre, &Dense, None, all, 16, &|_| false).expect("dense");
    assert_eq!(e.tokens, d.tokens);
    assert!((e.stats.density() - 1.0).abs() < 1e-12);
}

#[test]
fn agent_sessions_are_deterministic_and_continue_the_last_file() {
    let Some(m) = model() else { return };
    let docs: Vec<Document> = (0..6)
        .map(|i| Document {
            path: format!("django/mod{i}.py"),
            sha256: String::new(),
            text: (0..200)
                .map(|j| format!("def f_{i}_{j}(x):\n    return x + {j}\n"))
                .collect(),
        })
        .collect();
    let a = session(&docs, m.tokenizer(), 2048, 16, 1, 0).expect("session");
    let b = session(&docs, m.tokenizer(), 2048, 16, 1, 0).expect("session");
    assert_eq!(a.prompt_ids, b.prompt_ids);
    assert_eq!(a.continuation, b.continuation);
    assert_eq!(a.continuation.len(), 16);
    assert!(
        a.prompt_tokens <= 2048 - 16 && a.prompt_tokens > 1500,
        "{}",
        a.prompt_tokens
    );
    let text = m.tokenizer().decode(&a.prompt_ids).expect("decode");
    let last = a.files.last().expect("files");
    assert!(text.contains(&format!("read_file {last}")));
    // The last prompt token holds a newline (it may carry the next line's indentation too).
    assert!(
        text.trim_end_matches(' ').ends_with('\n'),
        "cut at a line boundary: {:?}",
        &text[text.len().saturating_sub(40)..]
    );
    let file = &docs.iter().find(|d| *last == d.path).expect("doc").text;
    let tail: String = text
        .rsplit(&format!("Tool (read_file {last}):\n"))
        .next()
        .expect("tail")
        .to_string();
    assert!(
        file.starts_with(&(tail.clone() + &a.continuation_text)),
        "the continuation is the file's next text"
    );
}

#[test]
fn the_chat_format_keeps_ruler_structure_inside_the_models_turn() {
    let Some(m) = model() else { return };
    let Some(words) = words() else { return };
    let (tok, hay) = (m.tokenizer(), haystack());
    let mut p = params(2048);
    p.format = fathom_eval::ruler::PromptFormat::Chat(
        fathom_eval::ruler::ChatTurn::for_model("smollm2-135m").unwrap(),
    );
    for task in Task::ALL {
        let chat = generate(task, &p, tok, &hay, &words, 0).unwrap();
        let plain = generate(task, &params(2048), tok, &hay, &words, 0).unwrap();
        assert!(chat.prompt.starts_with("<|im_start|>user\n"), "{task:?}");
        assert!(
            chat.prompt.contains("<|im_end|>\n<|im_start|>assistant\n"),
            "{task:?}"
        );
        assert!(
            chat.prompt_tokens + chat.max_new <= 2048,
            "{task:?} overflows"
        );
        // The same needles, gold and question: only the wording around them changes.
        assert_eq!(chat.gold, plain.gold, "{task:?}");
        assert_eq!(chat.depths, plain.depths, "{task:?}");
        let one = chat.gold.len() == 1;
        let single = "The special magic number for";
        if matches!(task, Task::NiahSingle | Task::NiahMultikey) {
            assert!(
                one && chat.prompt.ends_with("mentioned in the provided text is"),
                "{task:?}"
            );
            assert!(chat.prompt.contains(single));
        }
        if task == Task::NiahMultivalue {
            assert!(chat.prompt.ends_with("mentioned in the provided text are"));
        }
    }
}

/// A [`BatchedBackend`] that decodes its batches on the CPU, one prompt at a time, as the runs
/// do without one: the batched path must score its branches exactly as the CPU path does.
struct CpuBatches<'a> {
    b: Branching<'a>,
    rows_reported: usize,
}

impl BatchedBackend for CpuBatches<'_> {
    fn name(&self) -> &str {
        "test CPU"
    }

    fn greedy(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<Batched, BoxError> {
        assert_eq!(stop_tokens, self.b.model.tokenizer().stop_tokens());
        let mut out = Batched::default();
        for p in prompts {
            let pre = Prefill::new(self.b.model, p, max_new, self.b.calib, false)?;
            out.prefill_seconds.push(0.0);
            let per = self
                .b
                .methods
                .iter()
                .map(|m| {
                    decode_branch(
                        self.b.model,
                        &pre,
                        m.as_ref(),
                        self.b.calib,
                        self.b.params,
                        max_new,
                        stop,
                    )
                    .map(|br| (br, 0.0))
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.branches.push(per);
        }
        Ok(out)
    }

    fn forced(&mut self, prompts: &[&[u32]], forced: &[&[u32]]) -> Result<Batched, BoxError> {
        let mut out = Batched::default();
        for (p, f) in prompts.iter().zip(forced) {
            let pre = Prefill::new(self.b.model, p, f.len(), self.b.calib, false)?;
            out.prefill_seconds.push(0.0);
            let per = self
                .b
                .methods
                .iter()
                .map(|m| {
                    forced_branch(
                        self.b.model,
                        &pre,
                        m.as_ref(),
                        self.b.calib,
                        self.b.params,
                        f,
                    )
                    .map(|br| (br, 0.0))
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.branches.push(per);
        }
        Ok(out)
    }

    fn add_row_counters(&mut self, rows: &mut [Vec<RowCacheTally>]) {
        assert_eq!(rows.len(), self.b.methods.len());
        self.rows_reported += 1;
    }
}

/// Counts a run's progress reports: branches done and records.
fn counting<'a, R>(
    branches: &'a mut u64,
    done: &'a mut usize,
) -> impl FnMut(Progress<'_, R>) -> Result<(), BoxError> + 'a {
    move |p| {
        match p {
            Progress::Working(m) => assert!(!m.is_empty()),
            Progress::Branches(n) => *branches += n,
            Progress::Done(_) => *done += 1,
        }
        Ok(())
    }
}

#[test]
fn whole_runs_score_batched_branches_as_their_own() {
    let Some(m) = model() else { return };
    let Some(words) = words() else { return };
    let methods: Vec<Box<dyn Scanner>> =
        vec![Box::new(Dense), Box::new(Exact), Box::new(SparQ { r: 16 })];
    let b = Branching {
        model: m,
        methods: &methods,
        calib: None,
        params: SelectParams {
            sink: 4,
            local: 32,
            k: 16,
        },
    };
    // RULER: one task, two samples of 6 tokens each.
    let tp = TaskParams {
        tokens_to_generate: Some(6),
        ..params(512)
    };
    let hay = haystack();
    let plan = RulerPlan {
        tasks: &[Task::NiahSingle],
        samples: 2,
        params: &tp,
        haystack: &hay,
        words: &words,
        line_stop: true,
    };
    let (mut branches, mut done) = (0, 0);
    let cpu = ruler::run(b, &plan, None, &mut counting(&mut branches, &mut done)).expect("run");
    assert_eq!((branches, done), (6, 2));
    let mut backend = CpuBatches {
        b,
        rows_reported: 0,
    };
    let (mut branches, mut done) = (0, 0);
    let batched = ruler::run(
        b,
        &plan,
        Some(&mut backend),
        &mut counting(&mut branches, &mut done),
    )
    .expect("batched run");
    assert_eq!((branches, done, backend.rows_reported), (6, 2, 1));
    assert_eq!(cpu.records.len(), 2);
    for (x, y) in cpu.records.iter().zip(&batched.records) {
        assert_eq!(x.sample.prompt_ids, y.sample.prompt_ids);
        let names: Vec<&str> = x.methods.iter().map(|g| g.method.as_str()).collect();
        assert_eq!(names, ["dense", "exact", "sparq:16"]);
        for (g, h) in x.methods.iter().zip(&y.methods) {
            let (g, h) = (&g.result, &h.result);
            assert_eq!(
                (
                    &g.generation,
                    g.score,
                    g.same_as_exact,
                    g.first_divergence_from_exact
                ),
                (
                    &h.generation,
                    h.score,
                    h.same_as_exact,
                    h.first_divergence_from_exact
                )
            );
            assert!(g.tokens >= 1 && g.tokens <= 6);
        }
        assert!(x.methods[1].result.same_as_exact);
    }
    let t = &cpu.tasks[0];
    assert_eq!(t.task, Task::NiahSingle);
    for (mi, s) in t.methods.iter().enumerate() {
        let same = cpu
            .records
            .iter()
            .filter(|r| r.methods[mi].result.same_as_exact)
            .count();
        assert_eq!(s.same_as_exact, same);
        assert_eq!(s.score, s.score_sum / 2.0);
        assert_eq!(cpu.mean_score(mi), s.score);
        let s2 = &batched.tasks[0].methods[mi];
        assert_eq!(
            (s.score, s.same_as_exact, &s.row_cache),
            (s2.score, s2.same_as_exact, &s2.row_cache)
        );
    }
    assert!(t.methods[0].row_cache.is_empty(), "dense fetches no union");
    assert!(
        !t.methods[2].row_cache.is_empty(),
        "sparq's modelled row cache"
    );
    // Agent steps: one session of 8 forced steps over made-up code.
    let docs: Vec<Document> = (0..4)
        .map(|i| Document {
            path: format!("django/mod{i}.py"),
            sha256: String::new(),
            text: (0..60)
                .map(|j| format!("def f_{i}_{j}(x):\n    return x + {j}\n"))
                .collect(),
        })
        .collect();
    let plan = AgentPlan {
        docs: &docs,
        context: 640,
        steps: 8,
        seed: 1,
        sessions: 1,
    };
    let (mut branches, mut done) = (0, 0);
    let cpu = agent::run(b, &plan, None, &mut counting(&mut branches, &mut done)).expect("agent");
    assert_eq!((branches, done), (3, 1));
    let batched = agent::run(b, &plan, Some(&mut backend), &mut |_| Ok(())).expect("agent batched");
    let r = &cpu.records[0];
    assert_eq!(r.session.continuation.len(), 8);
    for (mi, (s, t)) in r
        .methods
        .iter()
        .zip(&batched.records[0].methods)
        .enumerate()
    {
        let (s, t) = (&s.result, &t.result);
        assert_eq!(s.argmax.len(), 8);
        assert_eq!((&s.argmax, s.agree_exact), (&t.argmax, t.agree_exact));
        assert_eq!(cpu.summary[mi].agree_exact, s.agree_exact);
    }
    assert_eq!(r.methods[0].result.agree_dense, 1.0);
    assert_eq!(r.methods[1].result.agree_exact, 1.0);
    // A progress callback's error stops the run and comes back as the caller's.
    let err = agent::run(b, &plan, None, &mut |_| Err("stop here".into())).expect_err("stops");
    assert!(matches!(err, fathom_eval::EvalError::Caller(_)) && err.to_string() == "stop here");
}
