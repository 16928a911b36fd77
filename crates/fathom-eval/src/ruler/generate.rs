//! Prompt generation (the module docs of [`super`] give the rules): real-text haystacks cut
//! into sentences, needles planted at RULER's depths, `vt`'s chains and in-context example,
//! `fwe`'s coded words, each sized by binary search to the largest that fits the context.

use fathom_model::Tokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;
use crate::words::WordList;
use crate::EvalError;

const VT_TEMPLATE: &str = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.";
const VT_ANSWER: &str = " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined the value {query}, they are: ";
const FWE_TEMPLATE: &str = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?";
const FWE_ANSWER: &str =
    " Answer: According to the coded text above, the three most frequently appeared words are:";

/// Splits text into sentences (a sentence ends at a word ending in `.`, `!` or `?`).
fn sentences<'a>(words: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for w in words {
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.push_str(w);
        if w.ends_with(['.', '!', '?']) {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Inserts `items[i]` before sentence `⌊frac_i · S⌋` (fractions sorted; ties keep order).
fn plant(sents: &[String], items: &[(f64, String)]) -> String {
    let s = sents.len();
    let mut at: Vec<(usize, &str)> = items
        .iter()
        .map(|(f, t)| (((f * s as f64) as usize).min(s), t.as_str()))
        .collect();
    at.sort_by_key(|x| x.0);
    let mut parts: Vec<&str> = Vec::with_capacity(s + items.len());
    let mut j = 0;
    for (i, sent) in sents.iter().enumerate() {
        while j < at.len() && at[j].0 == i {
            parts.push(at[j].1);
            j += 1;
        }
        parts.push(sent);
    }
    while j < at.len() {
        parts.push(at[j].1);
        j += 1;
    }
    parts.join(" ")
}

/// RULER's `vt` haystack: one line of noise, repeated (`variable_tracking.py`'s only one).
pub const VT_NOISE: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n";

/// A task's `m` haystack units, between which its needles or statements are planted: `m`
/// lines of [`VT_NOISE`] (`noise`), or the sentences of the real-text haystack's `m` words
/// from `offset`.
fn haystack_units(noise: bool, haystack: &Haystack, offset: usize, m: usize) -> Vec<String> {
    if noise {
        vec![VT_NOISE.to_string(); m]
    } else {
        sentences(haystack.take(offset, m))
    }
}

/// The largest `m` in `0..=hi` with `fits(m)` (monotone), or an error if not even 0 fits.
fn largest_fitting(
    hi: usize,
    mut fits: impl FnMut(usize) -> Result<bool, EvalError>,
) -> Result<usize, EvalError> {
    if !fits(0)? {
        return Err(EvalError::Invalid(
            "the context is too short for the task's template".into(),
        ));
    }
    let (mut lo, mut hi) = (0usize, hi);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}

fn random_number(rng: &mut StdRng, digits: u32) -> String {
    let lo = 10u64.pow(digits - 1);
    rng.gen_range(lo..lo * 10).to_string()
}

fn join_query(keys: &[String]) -> String {
    match keys {
        [one] => one.clone(),
        [init @ .., last] => format!("{}, and {last}", init.join(", ")),
        [] => String::new(),
    }
}

/// Generates sample `index` of `task` (see the [module docs](super)).
pub fn generate(
    task: Task,
    params: &TaskParams,
    tok: &Tokenizer,
    haystack: &Haystack,
    words: &WordList,
    index: usize,
) -> Result<Sample, EvalError> {
    let seed = sample_seed(params.seed, task, index);
    let mut rng = StdRng::seed_from_u64(seed);
    let max_new = params
        .tokens_to_generate
        .unwrap_or(task.tokens_to_generate());
    let budget = params.context.checked_sub(max_new).ok_or_else(|| {
        EvalError::Invalid(format!(
            "context {} is shorter than the {max_new} tokens to generate",
            params.context
        ))
    })?;
    let offset = rng.gen_range(0..haystack.words.len());
    let count = |text: &str| -> Result<usize, EvalError> { Ok(tok.encode(text)?.len()) };
    let mut example_tokens = 0;
    let (prompt, gold, question, m, depths_used) = match task {
        Task::Fwe => {
            let (template, gold, m) = fwe(&mut rng, budget, &params.format, &count)?;
            let q = template
                .rsplit_once("\nQuestion:")
                .map_or(String::new(), |x| format!("Question:{}", x.1));
            (template, gold, q, m, Vec::new())
        }
        Task::Vt => {
            let (vars, value, items) = vt_chain(&mut rng, params.shape.chain, 5);
            let question = VT_TEMPLATE
                .rsplit_once("{context}")
                .map_or("", |x| x.1)
                .replace("{query}", &value);
            // The example draws from its own stream, so the task itself is the same prompt
            // with or without it (only the haystack shrinks to make room).
            let example = if params.vt_example {
                let (text, n) = vt_example(seed, vars.len(), haystack, params.vt_noise, &count)?;
                example_tokens = n;
                format!("{text}\n\n")
            } else {
                String::new()
            };
            let build = |m: usize| -> String {
                let ctx = plant(
                    &haystack_units(params.vt_noise, haystack, offset, m),
                    &items,
                );
                let t = VT_TEMPLATE
                    .replace("{context}", &ctx)
                    .replace("{query}", &value);
                let a = VT_ANSWER
                    .replace("{num_v}", &vars.len().to_string())
                    .replace("{query}", &value);
                params.format.wrap(&format!("{example}{t}"), &a)
            };
            let m = largest_fitting(budget, |m| Ok(count(&build(m))? <= budget))?;
            (build(m), vars, question, m, Vec::new())
        }
        _ => {
            let sh = params.shape;
            let (n_keys, n_values, n_queries) = match task {
                Task::NiahSingle => (1, 1, 1),
                Task::NiahMultikey => (sh.keys.max(1), 1, 1),
                Task::NiahMultivalue => (1, sh.values.max(1), 1),
                _ => (sh.keys.max(1), 1, sh.keys.max(1)),
            };
            let mut keys: Vec<String> = Vec::new();
            while keys.len() < n_keys {
                let a = words
                    .adjectives
                    .choose(&mut rng)
                    .cloned()
                    .unwrap_or_default();
                let n = words.nouns.choose(&mut rng).cloned().unwrap_or_default();
                let k = format!("{a}-{n}");
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
            let mut needles: Vec<(String, String)> = Vec::new();
            let mut values: Vec<Vec<String>> = Vec::new();
            for k in &keys {
                let mut vs = Vec::new();
                while vs.len() < n_values {
                    let v = random_number(&mut rng, params.shape.digits.clamp(1, 18));
                    if !vs.contains(&v) {
                        vs.push(v);
                    }
                }
                for v in &vs {
                    needles.push((k.clone(), v.clone()));
                }
                values.push(vs);
            }
            needles.shuffle(&mut rng);
            let all = depths();
            let chosen: Vec<u32> = all
                .choose_multiple(&mut rng, needles.len())
                .copied()
                .collect();
            let items: Vec<(f64, String)> = chosen
                .iter()
                .zip(&needles)
                .map(|(d, (k, v))| (*d as f64 / 100.0, sh.needle.sentence(k, v)))
                .collect();
            let queries = &keys[..n_queries];
            let query = join_query(queries);
            let gold: Vec<String> = values[..n_queries].iter().flatten().cloned().collect();
            let (template, answer) = sh.needle.template(&params.format, gold.len());
            let question = template
                .rsplit_once("{context}")
                .map_or("", |x| x.1)
                .replace("{query}", &query);
            let answer = sh.answer.finish(
                answer.replace("{query}", &query),
                gold.len(),
                sh.needle,
                &queries[0],
            );
            let build = |m: usize| -> String {
                let ctx = plant(
                    &haystack_units(params.niah_noise, haystack, offset, m),
                    &items,
                );
                let t = template
                    .replace("{context}", &ctx)
                    .replace("{query}", &query);
                params.format.wrap(&t, &answer)
            };
            let m = largest_fitting(budget, |m| Ok(count(&build(m))? <= budget))?;
            (build(m), gold, question, m, chosen)
        }
    };
    let prompt_ids = tok.encode(&prompt)?;
    Ok(Sample {
        task,
        index,
        seed,
        prompt_tokens: prompt_ids.len(),
        prompt,
        prompt_ids,
        max_new,
        gold,
        question,
        haystack_words: m,
        haystack_offset: match task {
            Task::Fwe => 0,
            Task::Vt if params.vt_noise => 0,
            Task::Vt => offset,
            _ if params.niah_noise => 0,
            _ => offset,
        },
        depths: depths_used,
        example_tokens,
    })
}

/// A `vt` chain drawn from `rng`: `chain` (at least 1) distinct names of `letters` uppercase
/// letters, a 5-digit value (RULER's), and the statements `VAR n0 = value`, `VAR n1 = VAR n0`,
/// … each at a random fraction of the haystack, fractions sorted so the chain reads in order.
fn vt_chain(
    rng: &mut StdRng,
    chain: usize,
    letters: usize,
) -> (Vec<String>, String, Vec<(f64, String)>) {
    let mut vars: Vec<String> = Vec::new();
    while vars.len() < chain.max(1) {
        let s: String = (0..letters)
            .map(|_| rng.gen_range(b'A'..=b'Z') as char)
            .collect();
        if !vars.contains(&s) {
            vars.push(s);
        }
    }
    let value = random_number(rng, 5);
    let mut lines = vec![format!("VAR {} = {value}", vars[0])];
    for j in 0..vars.len() - 1 {
        lines.push(format!("VAR {} = VAR {} ", vars[j + 1], vars[j]));
    }
    let mut fracs: Vec<f64> = (0..lines.len()).map(|_| rng.gen::<f64>()).collect();
    fracs.sort_by(f64::total_cmp);
    let items = fracs.into_iter().zip(lines).collect();
    (vars, value, items)
}

/// RULER's `vt` in-context example fits this many tokens, `tokens_to_generate` included
/// (`variable_tracking.py` builds it at `max_seq_length = 500`).
pub const VT_EXAMPLE_TOKENS: usize = 500;

/// RULER's in-context example for `vt`: the task's own template and answer prefix over a
/// short stretch of the haystack (at a word offset drawn from the example's own stream,
/// seeded by the sample's seed), a chain of `chain` variables with 3-letter names (RULER's
/// example names are 3 letters, the task's 5) planted in order at random sentence
/// boundaries, then the answer: the names, space-separated. Sized by the same binary search
/// as the task, to the largest that keeps it within [`VT_EXAMPLE_TOKENS`] − 30 (vt's
/// `tokens_to_generate`). Returns the text and its token count.
fn vt_example(
    seed: u64,
    chain: usize,
    haystack: &Haystack,
    noise: bool,
    count: &dyn Fn(&str) -> Result<usize, EvalError>,
) -> Result<(String, usize), EvalError> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5654_4558_414d_504c); // "VTEXAMPL"
    let (vars, value, items) = vt_chain(&mut rng, chain, 3);
    let offset = rng.gen_range(0..haystack.words.len());
    let build = |m: usize| -> String {
        let ctx = plant(&haystack_units(noise, haystack, offset, m), &items);
        format!(
            "{}{}{}",
            VT_TEMPLATE
                .replace("{context}", &ctx)
                .replace("{query}", &value),
            VT_ANSWER
                .replace("{num_v}", &vars.len().to_string())
                .replace("{query}", &value),
            vars.join(" ")
        )
    };
    let budget = VT_EXAMPLE_TOKENS - Task::Vt.tokens_to_generate();
    let m = largest_fitting(budget, |m| Ok(count(&build(m))? <= budget))?;
    let text = build(m);
    let n = count(&text)?;
    Ok((text, n))
}

/// Frequent-word extraction: RULER's vocabulary of random 6-letter words, the first (after a
/// seeded shuffle) replaced by `...`, word `k` repeated `⌊W·k^{−α}/ζ(α)⌋` times (α = 2),
/// shuffled; `W` is the largest that fits. Gold: the words of rank 2–4.
fn fwe(
    rng: &mut StdRng,
    budget: usize,
    format: &PromptFormat,
    count: &dyn Fn(&str) -> Result<usize, EvalError>,
) -> Result<(String, Vec<String>, usize), EvalError> {
    const VOCAB: usize = 2000;
    const ALPHA: f64 = 2.0;
    let zeta2 = std::f64::consts::PI * std::f64::consts::PI / 6.0;
    let mut vocab = std::collections::BTreeSet::new();
    while vocab.len() < VOCAB {
        let w: String = (0..6).map(|_| rng.gen_range(b'a'..=b'z') as char).collect();
        vocab.insert(w);
    }
    let mut vocab: Vec<String> = vocab.into_iter().collect();
    vocab.shuffle(rng);
    vocab[0] = "...".into();
    let shuffle_seed: u64 = rng.gen();
    let build = |w: usize| -> String {
        let mut words: Vec<&str> = Vec::new();
        for (k, v) in vocab.iter().enumerate() {
            let c = (w as f64 * ((k + 1) as f64).powf(-ALPHA) / zeta2) as usize;
            words.extend(std::iter::repeat_n(v.as_str(), c));
        }
        words.shuffle(&mut StdRng::seed_from_u64(shuffle_seed));
        format.wrap(
            &FWE_TEMPLATE.replace("{context}", &words.join(" ")),
            FWE_ANSWER,
        )
    };
    let w = largest_fitting(budget, |w| Ok(count(&build(w))? <= budget))?;
    Ok((build(w), vocab[1..4].to_vec(), w))
}
