//! Whole secure-aggregation rounds in memory: the aggregator's result equals the plain
//! weighted sum within the fixed-point rounding, a masked input on its own is noise, a
//! device that vanishes after sharing does not stop the round, and tampering or an
//! unmasking request that would expose someone is refused.

use fedpo_secagg::{Client, FixedPoint, Party, SecAggError, Server, ShareBundle};
use rand::{Rng, SeedableRng};

const ROUND: u64 = 7;
const LEN: usize = 1000;

/// Party k's update (uniform in ±1) and weight (its pair count, 1 + k).
fn inputs(parties: usize) -> Vec<(Vec<f32>, f32)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    (0..parties).map(|k| ((0..LEN).map(|_| rng.random_range(-1.0..1.0)).collect(), 1.0 + k as f32)).collect()
}

struct Round {
    clients: Vec<Client>,
    server: Server,
    fp: FixedPoint,
}

/// Advertise and share among `parties`, with `threshold`.
fn set_up(parties: usize, threshold: usize, max_weight: f32) -> Round {
    let mut server = Server::new(ROUND, parties, threshold, LEN).unwrap();
    let mut clients: Vec<Client> = (0..parties).map(|k| Client::new(ROUND, k as Party, threshold)).collect();
    for (k, c) in clients.iter().enumerate() {
        server.advertise(k as Party, c.public_keys()).unwrap();
    }
    let keys = server.keys().to_vec();
    let mut mail: Vec<ShareBundle> = Vec::new();
    for (k, c) in clients.iter_mut().enumerate() {
        mail.extend(c.share(&keys).unwrap());
        server.shared(k as Party).unwrap();
    }
    for b in &mail {
        clients[usize::from(b.to)].receive(b).unwrap();
    }
    // Weighted updates in ±1 · max_weight, summed over every party.
    let fp = FixedPoint::for_sum(max_weight, parties);
    Round { clients, server, fp }
}

fn weighted(values: &[f32], w: f32) -> Vec<f32> {
    values.iter().map(|v| v * w).collect()
}

/// Runs the round; parties in `dropped` share but never send their input.
fn run(parties: usize, threshold: usize, dropped: &[Party]) -> (Vec<f64>, Vec<f64>, FixedPoint) {
    let data = inputs(parties);
    let max_weight = data.iter().map(|(_, w)| *w).fold(0.0, f32::max);
    let Round { clients, mut server, fp } = set_up(parties, threshold, max_weight);
    let sharing = server.sharing();
    for (k, c) in clients.iter().enumerate() {
        if dropped.contains(&(k as Party)) {
            continue;
        }
        let (values, w) = &data[k];
        server.add_input(k as Party, &c.masked_input(&weighted(values, *w), &fp, &sharing).unwrap()).unwrap();
    }
    let request = server.unmask_request().unwrap();
    assert_eq!(request.dropped, dropped);
    let responses: Vec<_> =
        request.survivors.iter().map(|&k| clients[usize::from(k)].unmask(&request).unwrap()).collect();
    let sum = server.finish(&responses, &fp).unwrap();
    let mut expected = vec![0.0f64; LEN];
    for (k, (values, w)) in data.iter().enumerate() {
        if !dropped.contains(&(k as Party)) {
            for (e, v) in expected.iter_mut().zip(weighted(values, *w)) {
                *e += f64::from(v);
            }
        }
    }
    (sum, expected, fp)
}

fn worst_gap(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn the_unmasked_sum_equals_the_plain_weighted_sum_within_the_rounding_bound() {
    let parties = 5;
    let (sum, expected, fp) = run(parties, 3, &[]);
    let bound = parties as f64 / (2.0 * fp.scale);
    let gap = worst_gap(&sum, &expected);
    assert!(gap <= bound, "gap {gap:e} over the rounding bound {bound:e}");
    // The weighted mean, as the aggregator would apply it (Σ w = 1 + 2 + 3 + 4 + 5).
    let mean_gap = gap / 15.0;
    assert!(mean_gap < 1e-7, "{mean_gap:e}");
}

#[test]
fn a_device_that_vanishes_after_sharing_leaves_the_sum_of_the_others() {
    let (sum, expected, fp) = run(5, 3, &[2]);
    assert!(worst_gap(&sum, &expected) <= 5.0 / (2.0 * fp.scale));
    let (sum, expected, fp) = run(6, 3, &[0, 5]);
    assert!(worst_gap(&sum, &expected) <= 6.0 / (2.0 * fp.scale));
}

#[test]
fn a_masked_input_on_its_own_is_uniform_noise_unrelated_to_the_update() {
    let data = inputs(4);
    let Round { clients, server, fp } = set_up(4, 3, 4.0);
    let sharing = server.sharing();
    let (values, w) = &data[1];
    let plain = fp.encode(&weighted(values, *w)).unwrap();
    let masked = clients[1].masked_input(&weighted(values, *w), &fp, &sharing).unwrap();
    let equal = plain.iter().zip(&masked).filter(|(a, b)| a == b).count();
    assert!(equal <= 1, "{equal} coordinates left unmasked");
    // Uniform on 2³²: the mean is near 2³¹ (std of the mean ≈ 2³² / √(12 · 1000) ≈ 3.9e7).
    let mean = masked.iter().map(|&v| f64::from(v)).sum::<f64>() / LEN as f64;
    assert!((mean - 2f64.powi(31)).abs() < 2e8, "mean {mean:e}");
    // Decoded as if it were an update, it says nothing about the real one.
    let decoded = fp.decode(&masked);
    let corr = correlation(&decoded, &values.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
    assert!(corr.abs() < 0.15, "correlation {corr}");
}

fn correlation(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    cov / (va * vb).sqrt()
}

#[test]
fn a_share_altered_in_transit_is_refused() {
    let parties = 3;
    let mut server = Server::new(ROUND, parties, 2, LEN).unwrap();
    let mut clients: Vec<Client> = (0..parties).map(|k| Client::new(ROUND, k as Party, 2)).collect();
    for (k, c) in clients.iter().enumerate() {
        server.advertise(k as Party, c.public_keys()).unwrap();
    }
    let keys = server.keys().to_vec();
    let mut bundles = clients[0].share(&keys).unwrap();
    clients[1].share(&keys).unwrap();
    let to_one = bundles.iter_mut().find(|b| b.to == 1).unwrap();
    to_one.ciphertext[5] ^= 1;
    assert_eq!(clients[1].receive(to_one), Err(SecAggError::Decrypt { from: 0, to: 1 }));
    // Addressed to someone else, it is refused too.
    let to_two = bundles.iter().find(|b| b.to == 2).unwrap().clone();
    assert!(clients[1].receive(&to_two).is_err());
}

#[test]
fn requests_that_would_expose_a_device_are_refused() {
    let Round { clients, mut server, fp } = set_up(4, 3, 1.0);
    let sharing = server.sharing();
    // Only two inputs under threshold 3: their sum would expose them.
    for k in 0..2u16 {
        let input = clients[usize::from(k)].masked_input(&[0.5; LEN], &fp, &sharing).unwrap();
        server.add_input(k, &input).unwrap();
    }
    assert!(matches!(server.unmask_request(), Err(SecAggError::TooFewInputs { got: 2, threshold: 3 })));
    // A request naming a party as survivor and dropped would reveal its input.
    let sneaky = fedpo_secagg::UnmaskRequest { survivors: vec![0, 1, 2], dropped: vec![2] };
    assert!(clients[0].unmask(&sneaky).unwrap_err().to_string().contains("both"));
    let short = fedpo_secagg::UnmaskRequest { survivors: vec![0, 1], dropped: vec![2, 3] };
    assert!(matches!(clients[0].unmask(&short), Err(SecAggError::TooFewInputs { .. })));
}
