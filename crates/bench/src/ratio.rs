//! Ratios of two sides' throughput, taken round by round.
//!
//! The two runs of one round ran one right after the other, so a slow moment of the machine slows
//! both. The ratio of each round cancels most of that; a ratio of two medians need not, since each
//! median may come from a different round. On the shared two-core machines this runs on, one
//! side's median moved by a fifth between runs of the same binary.

use std::fmt;

/// The median of the per-round ratios, and their lowest and highest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ratio {
    pub median: f64,
    pub low: f64,
    pub high: f64,
    pub rounds: usize,
}

impl Ratio {
    /// `a[r] / b[r]` for every round `r` both sides ran; `None` if they share no round or a
    /// denominator is zero.
    pub fn paired(a: &[f64], b: &[f64]) -> Option<Ratio> {
        let mut ratios: Vec<f64> = a
            .iter()
            .zip(b)
            .map(|(a, b)| (*b > 0.0).then(|| a / b))
            .collect::<Option<_>>()?;
        if ratios.is_empty() {
            return None;
        }
        ratios.sort_by(f64::total_cmp);
        let n = ratios.len();
        let median = if n % 2 == 1 {
            ratios[n / 2]
        } else {
            (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0
        };
        Some(Ratio {
            median,
            low: ratios[0],
            high: ratios[n - 1],
            rounds: n,
        })
    }
}

/// Every round of one workload on one side: the run of median throughput, whose figures a report
/// shows, and each round's throughput in round order, for the ratios.
pub struct Rounds<F> {
    pub median: F,
    pub throughput: Vec<f64>,
}

impl<F> Rounds<F> {
    /// `runs` in round order, and how to read a run's throughput. The median run is the lower
    /// middle one of an even count.
    pub fn of(mut runs: Vec<F>, throughput: impl Fn(&F) -> f64) -> Rounds<F> {
        assert!(!runs.is_empty(), "a workload ran at least one round");
        let in_order = runs.iter().map(&throughput).collect();
        runs.sort_by(|a, b| throughput(a).total_cmp(&throughput(b)));
        Rounds {
            median: runs.swap_remove((runs.len() - 1) / 2),
            throughput: in_order,
        }
    }

    /// This side's throughput over `other`'s, round by round, as the report prints it: `-` if
    /// there is none.
    pub fn ratio_to<G>(&self, other: &Rounds<G>) -> String {
        Ratio::paired(&self.throughput, &other.throughput)
            .map_or_else(|| "-".to_string(), |ratio| ratio.to_string())
    }
}

/// `0.81`, or with more than one round `0.81 (0.74-0.90)`: the median, then the range. Takes the
/// formatter's width for the whole.
impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = if self.rounds > 1 {
            format!("{:.2} ({:.2}-{:.2})", self.median, self.low, self.high)
        } else {
            format!("{:.2}", self.median)
        };
        f.pad(&text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_is_divided_by_its_own_round() {
        // Round 2 ran while the machine was twice as slow for both sides. A ratio of medians
        // would divide 100 by 180; the rounds themselves agree on 0.5.
        let ratio = Ratio::paired(&[100.0, 50.0, 110.0], &[200.0, 100.0, 220.0]).unwrap();
        assert_eq!(ratio.median, 0.5);
        assert_eq!((ratio.low, ratio.high), (0.5, 0.5));
        assert_eq!(ratio.rounds, 3);
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        let ratio = Ratio::paired(&[1.0, 3.0, 2.0, 4.0], &[1.0, 1.0, 1.0, 1.0]).unwrap();
        assert_eq!(ratio.median, 2.5);
        assert_eq!((ratio.low, ratio.high), (1.0, 4.0));
    }

    #[test]
    fn no_shared_round_or_a_zero_gives_no_ratio() {
        assert_eq!(Ratio::paired(&[], &[1.0]), None);
        assert_eq!(Ratio::paired(&[1.0, 2.0], &[1.0, 0.0]), None);
    }

    #[test]
    fn rounds_keep_their_order_for_the_ratios_and_pick_the_median_run() {
        // Runs as (name, keys/s), in round order.
        let fast = Rounds::of(vec![("a", 300.0), ("b", 100.0), ("c", 200.0)], |r| r.1);
        assert_eq!(fast.median.0, "c");
        assert_eq!(fast.throughput, [300.0, 100.0, 200.0]);
        let even = Rounds::of(vec![("a", 4.0), ("b", 1.0), ("c", 3.0), ("d", 2.0)], |r| {
            r.1
        });
        assert_eq!(even.median.0, "d", "the lower middle one");
        let slow = Rounds::of(vec![150.0, 50.0, 100.0], |r| *r);
        assert_eq!(fast.ratio_to(&slow), "2.00 (2.00-2.00)");
        assert_eq!(fast.ratio_to(&Rounds::of(vec![0.0], |r| *r)), "-");
    }

    #[test]
    fn one_round_prints_the_ratio_and_more_print_the_range() {
        let one = Ratio::paired(&[81.0], &[100.0]).unwrap();
        assert_eq!(format!("{one:>6}"), "  0.81");
        let three = Ratio::paired(&[74.0, 81.0, 90.0], &[100.0; 3]).unwrap();
        assert_eq!(format!("{three}"), "0.81 (0.74-0.90)");
    }
}
