//! Seeded synthetic preferences with heterogeneous personas: fedpo's built-in data.
//!
//! Each device is a *persona*. Every pair answers a how-to prompt with two responses that
//! vary along four **style axes** (length, tone, format, sign-off) and one **quality axis**
//! (a helpful answer with the task's real steps, or a deflection). A persona scores a
//! response as `2 * helpful + sum_a sign_a * pole_a`; the higher score is `chosen`. Quality
//! weighs more than any one style, and every persona agrees on it.
//!
//! `heterogeneity` in [0, 1] sets how many style axes conflict: the first
//! `round(4 * heterogeneity)` axes flip sign between even and odd personas. At 0 every
//! device wants the same thing; at 1 neighbours want opposite styles on every axis, and
//! only the quality axis is common ground.
//!
//! Tasks are split once: every fifth task is reserved for held-out pairs, so held-out
//! accuracy measures transfer to unseen prompts. The same seed gives the same bytes.
//!
//! These *opposed* personas are two, labelled without noise: a demonstration that
//! saturates. [`drawn`] draws a persona per device and noisy labels, for the science.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

use crate::error::{DataError, Result};
use crate::pair::PreferencePair;

mod drawn;

pub use drawn::{generate_drawn_device, DrawnDeviceData, DrawnPersona, QUALITY_WEIGHT};

/// Number of style axes.
pub const STYLE_AXES: usize = 4;

/// Settings of the generator.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticSpec {
    /// Share of conflicting style axes between neighbouring personas, in [0, 1].
    pub heterogeneity: f64,
    /// Training pairs per device (the paper uses 120).
    pub train_pairs: usize,
    /// Held-out pairs per device.
    pub heldout_pairs: usize,
    /// Seed of everything.
    pub seed: u64,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        Self { heterogeneity: 1.0, train_pairs: 120, heldout_pairs: 40, seed: 0 }
    }
}

/// What one device prefers: `+1` for the first pole of each style axis, `-1` for the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Persona {
    /// Device index.
    pub id: usize,
    /// Sign per style axis.
    pub signs: [i8; STYLE_AXES],
}

impl Persona {
    /// Persona `id` at a given heterogeneity.
    pub fn new(id: usize, heterogeneity: f64) -> Result<Self> {
        if !(0.0..=1.0).contains(&heterogeneity) {
            return Err(DataError::Invalid(format!("heterogeneity must be in [0, 1], got {heterogeneity}")));
        }
        let conflicting = (heterogeneity * STYLE_AXES as f64).round() as usize;
        let mut signs = [1i8; STYLE_AXES];
        for s in signs.iter_mut().take(conflicting) {
            *s = if id.is_multiple_of(2) { 1 } else { -1 };
        }
        Ok(Self { id, signs })
    }

    fn utility(&self, r: &ResponseStyle) -> i32 {
        let style: i32 =
            self.signs.iter().zip(r.poles).map(|(&s, first)| if first { s as i32 } else { -(s as i32) }).sum();
        2 * (r.helpful as i32) + style
    }
}

/// The design of one response: quality plus the pole of each style axis
/// (`true` = concise, formal, list, signed off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ResponseStyle {
    helpful: bool,
    poles: [bool; STYLE_AXES],
}

struct Task {
    what: &'static str,
    steps: [&'static str; 3],
}

const fn task(what: &'static str, steps: [&'static str; 3]) -> Task {
    Task { what, steps }
}

const TASKS: &[Task] = &[
    task(
        "brew a cup of tea",
        ["boil fresh water", "steep the leaves for three minutes", "strain and add milk if you like"],
    ),
    task(
        "plant tomato seedlings",
        ["pick a sunny spot", "bury the stem up to the first leaves", "water deeply at the base"],
    ),
    task(
        "back up my laptop",
        ["plug in an external drive", "turn on the system backup tool", "check that a restore works"],
    ),
    task(
        "learn to juggle",
        ["start with one ball", "throw in a steady arc at eye level", "add the third ball after a week"],
    ),
    task("fix a squeaky door", ["find the noisy hinge", "lift the pin halfway", "oil it and swing the door"]),
    task("make a budget", ["list your monthly income", "write down every fixed cost", "set limits for the rest"]),
    task(
        "clean a cast iron pan",
        ["rinse it with hot water", "scrub with coarse salt", "dry it and rub in a little oil"],
    ),
    task(
        "train for a 5k run",
        ["run three times a week", "mix easy runs with short intervals", "rest fully before race day"],
    ),
    task(
        "write a cover letter",
        ["read the job ad closely", "match two stories to its needs", "keep it under one page"],
    ),
    task(
        "bake sourdough bread",
        ["feed the starter the night before", "fold the dough every half hour", "bake it hot in a covered pot"],
    ),
    task(
        "set up a home network",
        ["place the router centrally", "change the admin password", "use WPA3 with a long passphrase"],
    ),
    task(
        "care for a succulent",
        ["give it bright light", "water only when the soil is dry", "use a pot with drainage"],
    ),
    task(
        "prepare for a job interview",
        ["research the company", "practise answers out loud", "prepare questions to ask"],
    ),
    task(
        "change a bike tire",
        ["release the brake and remove the wheel", "lever the tire off the rim", "seat the new tube and inflate"],
    ),
    task(
        "start meditating",
        ["sit comfortably for five minutes", "follow your breath", "return gently when your mind wanders"],
    ),
    task("paint a room", ["move furniture and cover the floor", "tape the edges", "apply two thin coats"]),
    task(
        "improve my sleep",
        ["keep a fixed wake-up time", "avoid screens before bed", "keep the bedroom cool and dark"],
    ),
    task(
        "make cold brew coffee",
        ["grind the beans coarsely", "steep them in cold water overnight", "filter and dilute to taste"],
    ),
    task(
        "organize my closet",
        ["empty it completely", "donate what you have not worn in a year", "group the rest by type"],
    ),
    task(
        "remove a coffee stain",
        ["blot it right away", "rinse from the back with cold water", "treat it with a drop of dish soap"],
    ),
    task("study for an exam", ["make a schedule", "test yourself with past questions", "sleep well the night before"]),
    task("write a good email subject", ["state the topic", "add any deadline", "keep it under eight words"]),
    task(
        "descale a kettle",
        ["fill it with equal parts vinegar and water", "boil and let it stand an hour", "rinse it several times"],
    ),
    task(
        "teach a dog to sit",
        ["hold a treat above its nose", "move it back over the head", "reward the moment it sits"],
    ),
    task("start a compost pile", ["choose a shady corner", "layer greens and browns", "turn it every two weeks"]),
    task("speed up a slow computer", ["restart it", "remove startup programs you do not need", "free up disk space"]),
    task(
        "make a paper airplane",
        ["fold a sheet in half lengthwise", "fold the top corners to the center", "fold the wings down evenly"],
    ),
    task(
        "prepare a simple salad dressing",
        ["mix three parts oil with one part vinegar", "add a pinch of salt", "shake it in a jar"],
    ),
    task(
        "wash a wool sweater",
        ["use cool water and wool detergent", "press the water out gently", "dry it flat on a towel"],
    ),
    task(
        "give a short presentation",
        ["open with the main point", "use three supporting ideas", "end with a clear ask"],
    ),
];

const DEFLECTION: [&str; 3] = ["search online for a guide", "ask someone who has done it", "try whatever seems right"];
const PROMPT_FORMS: [&str; 3] = ["How do I {}?", "What's the best way to {}?", "Can you explain how to {}?"];

fn sentence(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => format!("{}{}.", f.to_uppercase(), c.as_str()),
        None => String::new(),
    }
}

fn render(task: &Task, style: ResponseStyle) -> String {
    let [concise, formal, list, signed] = style.poles;
    let steps: Vec<&str> = if style.helpful { task.steps.to_vec() } else { DEFLECTION.to_vec() };
    let steps = if concise { &steps[..1] } else { &steps[..] };
    let mut out = String::from(if formal { "Certainly." } else { "Sure thing!" });
    if list {
        for (i, s) in steps.iter().enumerate() {
            out.push_str(&format!("\n{}. {}", i + 1, sentence(s)));
        }
    } else {
        let joins = ["First,", "Then,", "Finally,"];
        for (i, s) in steps.iter().enumerate() {
            let lead = if steps.len() == 1 { "Just" } else { joins[i.min(2)] };
            out.push_str(&format!(" {lead} {s}."));
        }
    }
    if !concise {
        out.push_str(if formal {
            " Taking each step carefully gives the most reliable result."
        } else {
            " Don't rush it, it's totally worth it."
        });
    }
    if signed {
        out.push_str(if formal { "\nI hope this is helpful." } else { "\nHope that helps, have fun!" });
    }
    out
}

fn random_style(rng: &mut StdRng) -> ResponseStyle {
    ResponseStyle { helpful: rng.random_bool(0.5), poles: std::array::from_fn(|_| rng.random_bool(0.5)) }
}

/// Whether task `i` is reserved for held-out pairs.
fn is_heldout_task(i: usize) -> bool {
    i % 5 == 4
}

fn pairs_for(persona: &Persona, heldout: bool, count: usize, rng: &mut StdRng) -> Vec<PreferencePair> {
    let tasks: Vec<&Task> =
        TASKS.iter().enumerate().filter(|(i, _)| is_heldout_task(*i) == heldout).map(|(_, t)| t).collect();
    let mut pairs = Vec::with_capacity(count);
    while pairs.len() < count {
        let task = tasks.choose(rng).copied().unwrap_or(&TASKS[0]);
        let (a, b) = (random_style(rng), random_style(rng));
        let (ua, ub) = (persona.utility(&a), persona.utility(&b));
        if ua == ub {
            continue; // no preference: draw again
        }
        let (chosen, rejected) = if ua > ub { (a, b) } else { (b, a) };
        let form = PROMPT_FORMS.choose(rng).copied().unwrap_or(PROMPT_FORMS[0]);
        pairs.push(PreferencePair {
            prompt: format!("User: {}\nAssistant:", form.replace("{}", task.what)),
            chosen: format!(" {}", render(task, chosen)),
            rejected: format!(" {}", render(task, rejected)),
            domain: Some(format!("persona-{}", persona.id)),
        });
    }
    pairs
}

/// Which synthetic personas a fleet holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Personas {
    /// Two opposed personas, labels without noise ([`generate_device`]).
    #[default]
    Opposed,
    /// One persona per device drawn around a shared one, noisy labels
    /// ([`generate_drawn_device`]).
    Drawn,
}

impl std::str::FromStr for Personas {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "opposed" => Ok(Self::Opposed),
            "drawn" => Ok(Self::Drawn),
            other => Err(format!("`{other}`: expected opposed or drawn")),
        }
    }
}

impl std::fmt::Display for Personas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Opposed => "opposed",
            Self::Drawn => "drawn",
        })
    }
}

/// Device `device`'s (train, held-out) pairs and held-out Bayes ceiling under `personas`
/// (labels at `temperature` for drawn ones; opposed ones are noiseless, ceiling 1).
pub fn generate_pairs(
    spec: &SyntheticSpec,
    personas: Personas,
    temperature: f64,
    device: usize,
) -> Result<(Vec<PreferencePair>, Vec<PreferencePair>, f64)> {
    match personas {
        Personas::Opposed => generate_device(spec, device).map(|d| (d.train, d.heldout, 1.0)),
        Personas::Drawn => {
            generate_drawn_device(spec, temperature, device).map(|d| (d.train, d.heldout, d.heldout_ceiling))
        }
    }
}

/// The seed of device `device`'s own random stream.
fn device_stream(seed: u64, device: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(device as u64)
}

/// The training and held-out pairs of one device.
#[derive(Debug, Clone)]
pub struct DeviceData {
    /// Its persona.
    pub persona: Persona,
    /// Pairs to train on.
    pub train: Vec<PreferencePair>,
    /// Pairs on unseen tasks, for held-out accuracy.
    pub heldout: Vec<PreferencePair>,
}

/// Generates device `device`'s data. Devices are independent streams of one seed, so a
/// device's data does not depend on how many devices the fleet has.
pub fn generate_device(spec: &SyntheticSpec, device: usize) -> Result<DeviceData> {
    let persona = Persona::new(device, spec.heterogeneity)?;
    let mut rng = StdRng::seed_from_u64(device_stream(spec.seed, device));
    let train = pairs_for(&persona, false, spec.train_pairs, &mut rng);
    let heldout = pairs_for(&persona, true, spec.heldout_pairs, &mut rng);
    Ok(DeviceData { persona, train, heldout })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_identical_pairs() {
        let spec = SyntheticSpec { seed: 7, ..SyntheticSpec::default() };
        let a = generate_device(&spec, 3).unwrap();
        let b = generate_device(&spec, 3).unwrap();
        assert_eq!(a.train, b.train);
        assert_eq!(a.heldout, b.heldout);
        let c = generate_device(&SyntheticSpec { seed: 8, ..spec }, 3).unwrap();
        assert_ne!(a.train, c.train);
    }

    #[test]
    fn zero_heterogeneity_gives_every_persona_the_same_preferences() {
        assert_eq!(Persona::new(0, 0.0).unwrap().signs, Persona::new(1, 0.0).unwrap().signs);
    }

    #[test]
    fn full_heterogeneity_makes_neighbours_opposite_on_every_style_axis() {
        let (a, b) = (Persona::new(0, 1.0).unwrap(), Persona::new(1, 1.0).unwrap());
        for axis in 0..STYLE_AXES {
            assert_eq!(a.signs[axis], -b.signs[axis]);
        }
        let half = Persona::new(1, 0.5).unwrap();
        assert_eq!(half.signs, [-1, -1, 1, 1]);
    }

    #[test]
    fn helpful_beats_unhelpful_for_every_persona_when_style_is_equal() {
        for id in 0..4 {
            let p = Persona::new(id, 1.0).unwrap();
            let poles = [true, false, true, false];
            assert!(
                p.utility(&ResponseStyle { helpful: true, poles })
                    > p.utility(&ResponseStyle { helpful: false, poles })
            );
        }
    }

    #[test]
    fn heldout_pairs_use_only_unseen_tasks() {
        let d = generate_device(&SyntheticSpec::default(), 0).unwrap();
        let heldout_tasks: Vec<&str> =
            TASKS.iter().enumerate().filter(|(i, _)| is_heldout_task(*i)).map(|(_, t)| t.what).collect();
        for pair in &d.train {
            assert!(!heldout_tasks.iter().any(|t| pair.prompt.contains(t)), "{}", pair.prompt);
        }
        for pair in &d.heldout {
            assert!(heldout_tasks.iter().any(|t| pair.prompt.contains(t)), "{}", pair.prompt);
        }
    }

    #[test]
    fn conflicting_personas_label_the_same_style_contrast_oppositely() {
        let task = &TASKS[0];
        let formal = ResponseStyle { helpful: true, poles: [true, true, true, true] };
        let casual = ResponseStyle { helpful: true, poles: [true, false, true, true] };
        let (a, b) = (Persona::new(0, 1.0).unwrap(), Persona::new(1, 1.0).unwrap());
        assert!(a.utility(&formal) > a.utility(&casual));
        assert!(b.utility(&formal) < b.utility(&casual));
        assert_ne!(render(task, formal), render(task, casual));
    }

    #[test]
    fn out_of_range_heterogeneity_is_rejected() {
        assert!(Persona::new(0, 1.5).is_err());
    }
}
