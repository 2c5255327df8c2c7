//! Small histories written by hand, each with the verdict a person reaches by reading it.

use bytes::Bytes;
use cairn_checker::{
    Call, CheckOptions, History, Operation, Outcome, Output, Report, Violation, check,
};
use std::time::Duration;

/// Operations on the key "k", built tersely.
struct Builder {
    operations: Vec<Operation>,
    key: &'static str,
}

impl Builder {
    fn new() -> Self {
        Builder {
            operations: Vec::new(),
            key: "k",
        }
    }

    fn on(mut self, key: &'static str) -> Self {
        self.key = key;
        self
    }

    fn push(mut self, client: u64, call: Call, outcome: Outcome, times: (u64, u64)) -> Self {
        self.operations.push(Operation {
            client,
            key: Bytes::from_static(self.key.as_bytes()),
            call,
            outcome,
            invoked_ms: times.0,
            completed_ms: times.1,
        });
        self
    }

    fn put(self, client: u64, value: &'static str, times: (u64, u64)) -> Self {
        self.push(client, put(value, None), Outcome::Ok(Output::Done), times)
    }

    fn put_ttl(self, client: u64, value: &'static str, ttl_ms: u64, times: (u64, u64)) -> Self {
        self.push(
            client,
            put(value, Some(ttl_ms)),
            Outcome::Ok(Output::Done),
            times,
        )
    }

    fn put_unknown(self, client: u64, value: &'static str, times: (u64, u64)) -> Self {
        self.push(client, put(value, None), Outcome::Unknown, times)
    }

    fn put_failed(self, client: u64, value: &'static str, times: (u64, u64)) -> Self {
        self.push(client, put(value, None), Outcome::Failed, times)
    }

    fn get(self, client: u64, seen: Option<&'static str>, times: (u64, u64)) -> Self {
        self.push(
            client,
            Call::Get,
            Outcome::Ok(Output::Value(seen.map(Bytes::from_static_str))),
            times,
        )
    }

    fn exists(self, client: u64, present: bool, times: (u64, u64)) -> Self {
        self.push(
            client,
            Call::Exists,
            Outcome::Ok(Output::Bool(present)),
            times,
        )
    }

    fn delete(self, client: u64, times: (u64, u64)) -> Self {
        self.push(client, Call::Delete, Outcome::Ok(Output::Done), times)
    }

    fn delete_unknown(self, client: u64, times: (u64, u64)) -> Self {
        self.push(client, Call::Delete, Outcome::Unknown, times)
    }

    fn insert(
        self,
        client: u64,
        value: &'static str,
        ttl_ms: Option<u64>,
        inserted: bool,
        times: (u64, u64),
    ) -> Self {
        self.push(
            client,
            Call::InsertIfAbsent {
                value: Bytes::from_static(value.as_bytes()),
                ttl_ms,
            },
            Outcome::Ok(Output::Bool(inserted)),
            times,
        )
    }

    fn insert_unknown(self, client: u64, value: &'static str, times: (u64, u64)) -> Self {
        self.push(
            client,
            Call::InsertIfAbsent {
                value: Bytes::from_static(value.as_bytes()),
                ttl_ms: None,
            },
            Outcome::Unknown,
            times,
        )
    }

    fn check(&self) -> Report {
        self.check_with(&CheckOptions::default())
    }

    fn check_with(&self, options: &CheckOptions) -> Report {
        check(&History::from_operations(self.operations.clone()), options)
    }
}

trait FromStaticStr {
    fn from_static_str(text: &'static str) -> Bytes;
}

impl FromStaticStr for Bytes {
    fn from_static_str(text: &'static str) -> Bytes {
        Bytes::from_static(text.as_bytes())
    }
}

fn put(value: &'static str, ttl_ms: Option<u64>) -> Call {
    Call::Put {
        value: Bytes::from_static(value.as_bytes()),
        ttl_ms,
    }
}

fn kinds(report: &Report) -> Vec<&'static str> {
    report.violations.iter().map(Violation::kind).collect()
}

fn assert_ok(report: &Report) {
    assert!(report.is_ok(), "expected no violation, got: {report}");
    assert!(report.inconclusive.is_empty(), "{report}");
}

fn assert_kinds(report: &Report, expected: &[&str]) {
    assert_eq!(kinds(report), expected, "{report}");
    assert!(!report.is_ok());
}

fn options_with_tolerance(clock_tolerance_ms: u64) -> CheckOptions {
    CheckOptions {
        clock_tolerance_ms,
        ..CheckOptions::default()
    }
}

#[test]
fn sequential_puts_gets_deletes_and_exists_pass() {
    let report = Builder::new()
        .get(1, None, (0, 1))
        .put(1, "a", (2, 3))
        .get(1, Some("a"), (4, 5))
        .exists(1, true, (6, 7))
        .put(2, "b", (8, 9))
        .get(1, Some("b"), (10, 11))
        .delete(2, (12, 13))
        .get(1, None, (14, 15))
        .exists(1, false, (16, 17))
        .check();
    assert_ok(&report);
    assert_eq!(report.keys_checked, 1);
    assert_eq!(report.operations, 9);
}

#[test]
fn a_get_overlapping_a_put_may_see_the_old_value_or_the_new_one_but_nothing_else() {
    let base = || Builder::new().put(1, "a", (0, 1)).put(1, "b", (2, 10));
    assert_ok(&base().get(2, Some("a"), (3, 4)).check());
    assert_ok(&base().get(2, Some("b"), (3, 4)).check());
    // Once seen, the new value stays: a later read cannot see the old one again.
    assert_ok(
        &base()
            .get(2, Some("b"), (3, 4))
            .get(3, Some("b"), (5, 6))
            .check(),
    );
    assert_kinds(
        &base()
            .get(2, Some("b"), (3, 4))
            .get(3, Some("a"), (5, 6))
            .check(),
        &["not linearizable"],
    );
    // Absent is neither: and not a lost write either, since the overlapping put of "b" could
    // have come between (it is the search that rejects it).
    assert_kinds(&base().get(2, None, (3, 4)).check(), &["not linearizable"]);
}

#[test]
fn a_stale_read_after_a_newer_put_completed_is_not_linearizable() {
    let report = Builder::new()
        .put(1, "a", (0, 1))
        .put(1, "b", (2, 3))
        .get(2, Some("a"), (4, 5))
        .check();
    assert!(kinds(&report).contains(&"not linearizable"), "{report}");
    let Some(Violation::NotLinearizable { operations, .. }) = report
        .violations
        .iter()
        .find(|violation| matches!(violation, Violation::NotLinearizable { .. }))
    else {
        panic!("no search violation in {report}");
    };
    // The order found, then the read that does not fit it.
    assert_eq!(operations.len(), 3);
    assert_eq!(operations[2].call, Call::Get);
}

#[test]
fn a_lost_write_is_reported_as_such_before_the_searchs_verdict() {
    let report = Builder::new()
        .put(1, "a", (0, 1))
        .get(2, None, (5, 6))
        .check();
    assert_kinds(&report, &["lost write", "not linearizable"]);
    let Violation::LostWrite { write, read, .. } = &report.violations[0] else {
        panic!("{report}");
    };
    assert_eq!(write.invoked_ms, 0);
    assert_eq!(read.invoked_ms, 5);
    // Another value instead of the written one is lost just the same.
    assert_kinds(
        &Builder::new()
            .put(1, "a", (0, 1))
            .put(1, "b", (2, 3))
            .get(2, Some("a"), (5, 6))
            .check(),
        &["lost write", "not linearizable"],
    );
    // But not when a delete of unknown outcome could have come in between.
    assert_ok(
        &Builder::new()
            .put(1, "a", (0, 1))
            .delete_unknown(3, (2, 3))
            .get(2, None, (5, 6))
            .check(),
    );
}

#[test]
fn two_inserts_answering_true_with_nothing_removing_the_first_are_a_double_insert() {
    let report = Builder::new()
        .insert(1, "a", None, true, (0, 1))
        .insert(2, "b", None, true, (5, 6))
        .check();
    assert_kinds(&report, &["double insert", "not linearizable"]);
    let Violation::DoubleInsert { first, second, .. } = &report.violations[0] else {
        panic!("{report}");
    };
    assert_eq!(first.client, 1);
    assert_eq!(second.client, 2);
    // Overlapping ones too: whichever went first, the other saw its value.
    assert_kinds(
        &Builder::new()
            .insert(1, "a", None, true, (0, 10))
            .insert(2, "b", None, true, (5, 6))
            .check(),
        &["double insert", "not linearizable"],
    );
}

#[test]
fn two_inserts_answering_true_separated_by_a_delete_pass() {
    assert_ok(
        &Builder::new()
            .insert(1, "a", None, true, (0, 1))
            .delete(3, (2, 3))
            .insert(2, "b", None, true, (5, 6))
            .insert(1, "c", None, false, (7, 8))
            .check(),
    );
}

#[test]
fn two_inserts_answering_true_separated_by_more_than_the_ttl_pass() {
    let report = Builder::new()
        .insert(1, "a", Some(100), true, (0, 1))
        .insert(2, "b", None, true, (500, 501))
        .check();
    assert_ok(&report);
    // Within the TTL (even stretched by the tolerance) the first value was still there.
    let report = Builder::new()
        .insert(1, "a", Some(1000), true, (0, 1))
        .insert(2, "b", None, true, (500, 501))
        .check();
    assert_kinds(&report, &["double insert", "not linearizable"]);
}

#[test]
fn two_inserts_answering_true_with_a_delete_of_unknown_outcome_between_pass() {
    assert_ok(
        &Builder::new()
            .insert(1, "a", None, true, (0, 1))
            .delete_unknown(3, (2, 3))
            .insert(2, "b", None, true, (10, 11))
            .check(),
    );
    // The unknown delete may even take effect long after its client gave up.
    assert_ok(
        &Builder::new()
            .delete_unknown(3, (0, 1))
            .insert(1, "a", None, true, (5, 6))
            .insert(2, "b", None, true, (10, 11))
            .check(),
    );
}

#[test]
fn a_put_of_unknown_outcome_may_be_observed_or_never_seen() {
    // Observed, even long after its client gave up.
    assert_ok(
        &Builder::new()
            .put(1, "a", (0, 1))
            .put_unknown(2, "b", (2, 3))
            .get(3, Some("a"), (10, 11))
            .get(3, Some("b"), (100, 101))
            .check(),
    );
    // Never observed.
    assert_ok(
        &Builder::new()
            .put(1, "a", (0, 1))
            .put_unknown(2, "b", (2, 3))
            .get(3, Some("a"), (10, 11))
            .get(3, Some("a"), (100, 101))
            .check(),
    );
    // But not before it was invoked: then the read shows "a" lost.
    assert_kinds(
        &Builder::new()
            .put(1, "a", (0, 1))
            .get(3, Some("b"), (2, 3))
            .put_unknown(2, "b", (5, 6))
            .check(),
        &["lost write", "not linearizable"],
    );
}

#[test]
fn an_unknown_put_observed_and_then_gone_without_another_write_is_a_violation() {
    let seen_then_old = Builder::new()
        .put(1, "a", (0, 1))
        .put_unknown(2, "b", (2, 3))
        .get(3, Some("b"), (10, 11))
        .get(3, Some("a"), (20, 21))
        .check();
    assert_kinds(&seen_then_old, &["not linearizable"]);
    let seen_then_absent = Builder::new()
        .put(1, "a", (0, 1))
        .put_unknown(2, "b", (2, 3))
        .get(3, Some("b"), (10, 11))
        .get(3, None, (20, 21))
        .check();
    assert_kinds(&seen_then_absent, &["not linearizable"]);
}

#[test]
fn an_insert_if_absent_of_unknown_outcome_may_or_may_not_have_inserted() {
    assert_ok(
        &Builder::new()
            .insert_unknown(1, "a", (0, 1))
            .get(2, Some("a"), (5, 6))
            .check(),
    );
    assert_ok(
        &Builder::new()
            .insert_unknown(1, "a", (0, 1))
            .get(2, None, (5, 6))
            .check(),
    );
    // If it inserted, it did so over an absent key only.
    assert_kinds(
        &Builder::new()
            .put(1, "x", (0, 1))
            .insert_unknown(1, "a", (2, 3))
            .get(2, Some("a"), (5, 6))
            .check(),
        &["not linearizable"],
    );
}

#[test]
fn failed_operations_are_ignored() {
    let report = Builder::new()
        .put(1, "a", (0, 1))
        .put_failed(2, "b", (2, 3))
        .get(3, Some("a"), (5, 6))
        .check();
    assert_ok(&report);
    assert_eq!(report.dropped_operations, 1);
    assert_eq!(report.operations, 2);
    // A failed put never took effect, so its value cannot be read.
    assert_kinds(
        &Builder::new()
            .put(1, "a", (0, 1))
            .put_failed(2, "b", (2, 3))
            .get(3, Some("b"), (5, 6))
            .check(),
        &["lost write", "not linearizable"],
    );
}

#[test]
fn reads_of_unknown_outcome_are_dropped() {
    let report = Builder::new()
        .put(1, "a", (0, 1))
        .push(2, Call::Get, Outcome::Unknown, (2, 3))
        .push(2, Call::Exists, Outcome::Unknown, (2, 3))
        .check();
    assert_ok(&report);
    assert_eq!(report.dropped_operations, 2);
}

#[test]
fn exists_must_agree_with_get() {
    assert_ok(
        &Builder::new()
            .put(1, "a", (0, 1))
            .exists(2, true, (2, 3))
            .get(2, Some("a"), (4, 5))
            .delete(1, (6, 7))
            .exists(2, false, (8, 9))
            .get(2, None, (10, 11))
            .check(),
    );
    assert_kinds(
        &Builder::new()
            .put(1, "a", (0, 1))
            .exists(2, false, (5, 6))
            .check(),
        &["lost write", "not linearizable"],
    );
    assert_kinds(
        &Builder::new()
            .get(2, None, (0, 1))
            .exists(2, true, (5, 6))
            .check(),
        &["not linearizable"],
    );
}

#[test]
fn a_value_past_its_ttl_is_absent_and_present_only_before() {
    let base = || Builder::new().put_ttl(1, "a", 100, (0, 10));
    assert_ok(&base().get(2, Some("a"), (50, 51)).check());
    assert_ok(&base().get(2, None, (510, 511)).check());
    assert_kinds(
        &base().get(2, Some("a"), (510, 511)).check(),
        &["not linearizable"],
    );
    // Once seen expired it stays expired.
    assert_kinds(
        &base()
            .get(2, None, (140, 141))
            .get(2, Some("a"), (145, 146))
            .check(),
        &["not linearizable"],
    );
    // Insert-if-absent sees an expired value as absent.
    assert_ok(
        &base()
            .insert(2, "b", None, true, (510, 511))
            .get(2, Some("b"), (520, 521))
            .check(),
    );
}

#[test]
fn the_clock_tolerance_is_respected_near_the_expiry() {
    // Written at exactly 1000 with a TTL of 100: with no tolerance it expires at exactly 1100.
    let at = |value: Option<&'static str>, time: u64, tolerance: u64| {
        Builder::new()
            .put_ttl(1, "a", 100, (1000, 1000))
            .get(2, value, (time, time))
            .check_with(&options_with_tolerance(tolerance))
    };
    assert_ok(&at(Some("a"), 1099, 0));
    assert_ok(&at(None, 1100, 0));
    assert_kinds(&at(Some("a"), 1100, 0), &["not linearizable"]);
    assert_kinds(&at(None, 1099, 0), &["lost write", "not linearizable"]);
    // With a tolerance of 10 ms, the expiry may be anywhere in [1080, 1120].
    assert_ok(&at(Some("a"), 1119, 10));
    assert_ok(&at(None, 1080, 10));
    assert_kinds(&at(Some("a"), 1120, 10), &["not linearizable"]);
    assert_kinds(&at(None, 1079, 10), &["lost write", "not linearizable"]);
    // A put that took 50 ms may have fixed its expiry anywhere in it.
    let slow_put = |value: Option<&'static str>, time: u64| {
        Builder::new()
            .put_ttl(1, "a", 100, (1000, 1050))
            .get(2, value, (time, time))
            .check_with(&options_with_tolerance(0))
    };
    assert_ok(&slow_put(None, 1100));
    assert_ok(&slow_put(Some("a"), 1149));
    assert_kinds(&slow_put(Some("a"), 1150), &["not linearizable"]);
}

#[test]
fn a_value_seen_live_late_forces_its_write_late() {
    // The put's point is in [0, 100]; seen live at 150 with a TTL of 100 and no tolerance, it
    // was written after 50, so a read completed by 40 cannot have seen it.
    let report = Builder::new()
        .put(3, "x", (0, 0))
        .put_ttl(1, "a", 100, (0, 100))
        .get(2, Some("x"), (45, 45))
        .get(2, Some("a"), (150, 150))
        .check_with(&options_with_tolerance(0));
    assert_ok(&report);
    let report = Builder::new()
        .put(3, "x", (0, 0))
        .put_ttl(1, "a", 100, (0, 100))
        .get(2, Some("a"), (40, 40))
        .get(2, Some("a"), (150, 150))
        .check_with(&options_with_tolerance(0));
    assert_kinds(&report, &["not linearizable"]);
}

#[test]
fn client_clock_skew_widens_every_interval() {
    // A stale read 3 ms after the newer put completed: a violation on one clock, not when the
    // clients' clocks may be 5 ms apart.
    let stale = Builder::new()
        .put(1, "a", (0, 1))
        .put(1, "b", (2, 3))
        .get(2, Some("a"), (6, 7));
    assert!(!stale.check().is_ok());
    let skewed = CheckOptions {
        client_clock_skew_ms: 5,
        ..CheckOptions::default()
    };
    assert_ok(&stale.check_with(&skewed));
}

#[test]
fn keys_are_checked_separately_and_reported_earliest_first() {
    let report = Builder::new()
        .on("late")
        .put(1, "a", (100, 101))
        .get(2, None, (110, 111))
        .on("fine")
        .put(1, "a", (0, 1))
        .get(2, Some("a"), (2, 3))
        .on("early")
        .put(1, "a", (10, 11))
        .put(1, "b", (12, 13))
        .get(2, Some("a"), (20, 21))
        .check();
    assert_eq!(report.keys_checked, 3);
    let keys: Vec<&[u8]> = report
        .violations
        .iter()
        .map(|violation| violation.key().as_ref())
        .collect();
    assert_eq!(
        keys,
        vec![b"early".as_ref(), b"early", b"late", b"late"],
        "{report}"
    );
}

#[test]
fn the_report_names_the_violation_with_times_relative_to_the_history() {
    let report = Builder::new()
        .put(1, "a", (1000, 1001))
        .get(7, None, (1005, 1006))
        .check();
    let shown = report.to_string();
    assert!(shown.contains("2 violation(s)"), "{shown}");
    assert!(shown.contains("key \"k\": lost write"), "{shown}");
    assert!(
        shown.contains("client 1: put \"a\" -> ok, invoked +0 ms, completed +1 ms"),
        "{shown}"
    );
    assert!(
        shown.contains("client 7: get -> absent, invoked +5 ms, completed +6 ms"),
        "{shown}"
    );
    let search = report.violations[1].to_string();
    assert!(search.contains("not linearizable"), "{search}");
    assert!(search.contains("the key holds \"a\""), "{search}");
    assert!(search.contains("client 7: get -> absent"), "{search}");
}

#[test]
fn an_answer_that_does_not_fit_its_call_is_reported_as_malformed() {
    let report = Builder::new()
        .push(1, put("a", None), Outcome::Ok(Output::Bool(true)), (0, 1))
        .check();
    assert!(report.violations.is_empty());
    assert_eq!(report.malformed.len(), 1);
    assert!(!report.is_ok());
    assert!(report.to_string().contains("malformed"));
}

#[test]
fn a_search_that_runs_out_of_time_is_inconclusive_not_failed() {
    let mut builder = Builder::new();
    for step in 0..3000 {
        builder = builder.put(1, "a", (step * 2, step * 2 + 1));
    }
    let report = builder.check_with(&CheckOptions {
        timeout: Some(Duration::ZERO),
        ..CheckOptions::default()
    });
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.inconclusive.len(), 1, "{report}");
    assert!(report.to_string().contains("inconclusive"));
}

#[test]
fn an_empty_history_passes() {
    let report = check(&History::new(), &CheckOptions::default());
    assert_ok(&report);
    assert_eq!(report.keys_checked, 0);
}
