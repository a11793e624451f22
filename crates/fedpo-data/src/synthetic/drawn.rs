//! Personas drawn from a distribution, with labels drawn from their utilities: a
//! synthetic benchmark that neither saturates nor favours personalisation by
//! construction.
//!
//! - **Personas.** Persona k weighs the four style axes with `w_k = (1 − h)·c + h·z_k`:
//!   `c` a component every persona shares and `z_k` its own, each axis N(0, 1), `c` drawn
//!   from the seed and `z_k` from the device's stream. Quality weighs [`QUALITY_WEIGHT`]
//!   for everyone. `h` (heterogeneity) 0 gives every device the same persona, so its pairs
//!   are i.i.d. across devices (a random split of one data set); 1 gives independent
//!   personas, which conflict on about half the axes for any two devices. Every device
//!   is its own persona.
//! - **Labels.** A response's utility is `QUALITY_WEIGHT·helpful + Σ_a w_a·(±1 per pole)`;
//!   a pair's label is drawn by Bradley–Terry, `P(a ≻ b) = σ((u_a − u_b)/T)`, so labels
//!   are noisy as human labels are, the more so the higher the temperature `T`.
//! - **Ceiling.** A device's Bayes accuracy on its held-out pairs is the share whose drawn
//!   label agrees with its true utility: what a model that knew the persona would score
//!   on those very pairs. Results are read against it.
//!
//! Held-out pairs come from tasks no device trains on, as with the opposed personas.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

use super::{is_heldout_task, random_style, render, ResponseStyle, SyntheticSpec, PROMPT_FORMS, STYLE_AXES, TASKS};
use crate::error::{DataError, Result};
use crate::pair::PreferencePair;

/// How much quality weighs against the style axes, whose weights are N(0, 1).
pub const QUALITY_WEIGHT: f64 = 2.0;

/// What one device prefers: a weight per style axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawnPersona {
    /// Device index.
    pub id: usize,
    /// Weight of each style axis's first pole (concise, formal, list, signed off).
    pub weights: [f64; STYLE_AXES],
}

fn normals(rng: &mut StdRng) -> [f64; STYLE_AXES] {
    std::array::from_fn(|_| StandardNormal.sample(rng))
}

impl DrawnPersona {
    /// Persona `id` of the fleet seeded by `seed`, at heterogeneity `h`.
    pub fn new(id: usize, h: f64, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&h) {
            return Err(DataError::Invalid(format!("heterogeneity must be in [0, 1], got {h}")));
        }
        let shared = normals(&mut StdRng::seed_from_u64(seed ^ 0x5348_4152_4544));
        let own = normals(&mut StdRng::seed_from_u64(super::device_stream(seed, id) ^ 0x004F_574E));
        Ok(Self { id, weights: std::array::from_fn(|a| (1.0 - h) * shared[a] + h * own[a]) })
    }

    fn utility(&self, r: &ResponseStyle) -> f64 {
        let style: f64 = self.weights.iter().zip(r.poles).map(|(w, first)| if first { *w } else { -w }).sum();
        QUALITY_WEIGHT * f64::from(u8::from(r.helpful)) + style
    }
}

/// One drawn-persona device's pairs and its ceiling.
#[derive(Debug, Clone)]
pub struct DrawnDeviceData {
    pub persona: DrawnPersona,
    pub train: Vec<PreferencePair>,
    pub heldout: Vec<PreferencePair>,
    /// Share of the held-out pairs whose label agrees with the persona's true utility.
    pub heldout_ceiling: f64,
}

/// Pairs for `persona` with Bradley–Terry labels at `temperature`, and how many of them
/// the true utility ranks the way the label does.
fn pairs_for(
    persona: &DrawnPersona,
    heldout: bool,
    count: usize,
    temperature: f64,
    rng: &mut StdRng,
) -> (Vec<PreferencePair>, usize) {
    let tasks: Vec<_> =
        TASKS.iter().enumerate().filter(|(i, _)| is_heldout_task(*i) == heldout).map(|(_, t)| t).collect();
    let mut pairs = Vec::with_capacity(count);
    let mut agree = 0;
    while pairs.len() < count {
        let task = tasks.choose(rng).copied().unwrap_or(&TASKS[0]);
        let (a, b) = (random_style(rng), random_style(rng));
        if a == b {
            continue; // the same response twice says nothing
        }
        let diff = persona.utility(&a) - persona.utility(&b);
        let p_a = 1.0 / (1.0 + (-diff / temperature).exp());
        let a_wins = rng.random_bool(p_a.clamp(0.0, 1.0));
        if a_wins == (diff > 0.0) {
            agree += 1;
        }
        let (chosen, rejected) = if a_wins { (a, b) } else { (b, a) };
        let form = PROMPT_FORMS.choose(rng).copied().unwrap_or(PROMPT_FORMS[0]);
        pairs.push(PreferencePair {
            prompt: format!("User: {}\nAssistant:", form.replace("{}", task.what)),
            chosen: format!(" {}", render(task, chosen)),
            rejected: format!(" {}", render(task, rejected)),
            domain: Some(format!("persona-{}", persona.id)),
        });
    }
    (pairs, agree)
}

/// Device `device`'s data under drawn personas, labels at `temperature`. Like
/// [`super::generate_device`], it does not depend on the fleet's size.
pub fn generate_drawn_device(spec: &SyntheticSpec, temperature: f64, device: usize) -> Result<DrawnDeviceData> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(DataError::Invalid(format!("the label temperature must be positive, got {temperature}")));
    }
    let persona = DrawnPersona::new(device, spec.heterogeneity, spec.seed)?;
    let mut rng = StdRng::seed_from_u64(super::device_stream(spec.seed, device) ^ 0x4C_4142_454C);
    let (train, _) = pairs_for(&persona, false, spec.train_pairs, temperature, &mut rng);
    let (heldout, agree) = pairs_for(&persona, true, spec.heldout_pairs, temperature, &mut rng);
    let heldout_ceiling = if heldout.is_empty() { 1.0 } else { agree as f64 / heldout.len() as f64 };
    Ok(DrawnDeviceData { persona, train, heldout, heldout_ceiling })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(h: f64, heldout: usize) -> SyntheticSpec {
        SyntheticSpec { heterogeneity: h, train_pairs: 8, heldout_pairs: heldout, seed: 11 }
    }

    #[test]
    fn zero_heterogeneity_is_one_shared_persona_and_full_gives_each_device_its_own() {
        let w = |h, id| DrawnPersona::new(id, h, 11).unwrap().weights;
        assert_eq!(w(0.0, 0), w(0.0, 7));
        let distinct: Vec<_> = (0..10).map(|id| w(1.0, id)).collect();
        for (i, a) in distinct.iter().enumerate() {
            assert!(distinct[i + 1..].iter().all(|b| a != b), "two devices share a persona");
        }
        // Independent personas disagree in sign on a good share of their axes.
        let opposed =
            (1..10).map(|id| (0..STYLE_AXES).filter(|&x| w(1.0, 0)[x] * w(1.0, id)[x] < 0.0).count()).sum::<usize>();
        assert!((8..=28).contains(&opposed), "{opposed} of 36 axis pairs opposed");
    }

    #[test]
    fn labels_are_noisier_at_higher_temperature_and_the_ceiling_measures_it() {
        let ceiling = |t| generate_drawn_device(&spec(0.5, 400), t, 3).unwrap().heldout_ceiling;
        let (sharp, noisy) = (ceiling(0.05), ceiling(4.0));
        // Even sharp labels flip where two responses' utilities nearly tie.
        assert!(sharp > 0.9, "{sharp}");
        assert!(noisy < 0.8 && noisy > 0.5 && sharp - noisy > 0.15, "{sharp} vs {noisy}");
        assert!(ceiling(1.0) < 1.0, "default-like temperatures must not saturate");
    }

    #[test]
    fn the_ceiling_is_the_share_of_heldout_labels_the_true_utility_agrees_with() {
        let d = generate_drawn_device(&spec(1.0, 200), 1.0, 2).unwrap();
        let style_of = |text: &str| {
            // Recover each response's style from its rendering.
            TASKS
                .iter()
                .flat_map(|t| {
                    (0..32u8).map(move |bits| {
                        let style = ResponseStyle {
                            helpful: bits & 16 != 0,
                            poles: std::array::from_fn(|a| bits & (1 << a) != 0),
                        };
                        (format!(" {}", render(t, style)), style)
                    })
                })
                .find(|(r, _)| r == text)
                .map(|(_, s)| s)
                .unwrap()
        };
        let agree = d
            .heldout
            .iter()
            .filter(|p| d.persona.utility(&style_of(&p.chosen)) > d.persona.utility(&style_of(&p.rejected)))
            .count();
        assert_eq!(d.heldout_ceiling, agree as f64 / d.heldout.len() as f64);
    }

    #[test]
    fn same_seed_same_pairs_and_a_device_does_not_depend_on_the_fleet() {
        let a = generate_drawn_device(&spec(0.5, 4), 1.0, 5).unwrap();
        let b = generate_drawn_device(&spec(0.5, 4), 1.0, 5).unwrap();
        assert_eq!((a.train, a.heldout), (b.train, b.heldout));
        assert!(generate_drawn_device(&spec(0.5, 4), 0.0, 5).is_err());
        assert!(DrawnPersona::new(0, 1.5, 0).is_err());
    }
}
