//! The command line as a script sees it: JSON on stdout, exit 2 on bad flags.

use std::process::{Command, Output};

fn sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stormguard-sim"))
        .args(args)
        .output()
        .expect("the binary runs")
}

#[test]
fn jitter_json_has_one_object_per_strategy() {
    let out = sim(&["jitter", "--clients", "100", "--runs", "2", "--json"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.trim();
    assert!(line.starts_with("[{") && line.ends_with("}]"), "{line}");
    for s in ["none", "exponential", "equal", "full", "decorrelated"] {
        assert!(
            line.contains(&format!(
                "{{\"strategy\":\"{s}\",\"clients\":100,\"calls\":"
            )),
            "{s}: {line}"
        );
    }
    assert_eq!(line.matches("\"completion_ms\":").count(), 5);
    // The speed report goes to stderr, so stdout stays JSON.
    assert!(String::from_utf8_lossy(&out.stderr).contains("events/s"));
}

#[test]
fn bad_flags_exit_2_with_a_reason() {
    for (args, reason) in [
        (
            &["fleet", "--clients", "zero"][..],
            "--clients: \"zero\" is not a number",
        ),
        (&["fleet", "--clients", "0"][..], "--clients: 0 is outside"),
        (&["fleet", "--bogus"][..], "unknown flag --bogus"),
        (&["storm"][..], "unknown command \"storm\""),
        (
            &["fleet", "--strategy", "none,retry-harder"][..],
            "unknown strategy \"retry-harder\"",
        ),
        (&["fleet", "--seed"][..], "--seed needs a value"),
        (&[][..], "no command given"),
    ] {
        let out = sim(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn fleet_prints_a_row_per_strategy_and_events_per_second() {
    let out = sim(&[
        "fleet",
        "--clients",
        "50",
        "--seconds",
        "6",
        "--strategy",
        "none,stormguard",
        "--json",
    ]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("\"strategy\":").count(), 2, "{stdout}");
    assert!(stdout.contains("\"events_per_sec\":"));
}

#[test]
fn fleet_reads_the_repository_s_configuration_file() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/stormguard.toml"
    );
    let out = sim(&[
        "fleet",
        "--config",
        file,
        "--dependency",
        "payments",
        "--clients",
        "50",
        "--seconds",
        "6",
        "--json",
        "--no-progress",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for row in ["\"none\"", "\"stormguard+breaker\"", "\"config:payments\""] {
        assert!(stdout.contains(row), "{row}: {stdout}");
    }
    assert!(!stdout.contains("config:search"), "{stdout}");
}

#[test]
fn fleet_config_errors_name_the_file_and_the_path() {
    let dir = std::env::temp_dir().join(format!("stormguard-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[dependencies.payments.retry]\nmax_attempts = 0\n").expect("write");
    let out = sim(&["fleet", "--config", bad.to_str().expect("utf-8 path")]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml: dependencies.payments.retry.max_attempts: 0 is not in 1..=100"),
        "{stderr}"
    );
}

#[test]
fn fleet_seeds_runs_each_seed_as_its_own_run_and_summarises_them() {
    let base = [
        "fleet",
        "--clients",
        "50",
        "--seconds",
        "6",
        "--scenario",
        "brownout",
        "--strategy",
        "none,standard",
        "--seed",
        "7",
    ];
    let json = |extra: &[&str]| {
        let out = sim(&[&base[..], extra, &["--json"]].concat());
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // Seed by seed, the same rows a run of that one seed gives (timing fields aside).
    let without_speed = |s: &str| {
        s.split(',')
            .filter(|f| !f.contains("events_per_sec"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let all = json(&["--seeds", "3"]);
    let runs: Vec<String> = ["7", "8", "9"]
        .iter()
        .map(|seed| {
            let one = sim(&[&base[..], &["--seed", seed, "--json"]].concat());
            without_speed(String::from_utf8_lossy(&one.stdout).trim())
        })
        .collect();
    assert!(all.starts_with("[[") && all.ends_with("]]"), "{all}");
    let per_seed = all[1..all.len() - 1]
        .split("],[")
        .map(|run| without_speed(&format!("[{}]", run.trim_matches(['[', ']']))))
        .collect::<Vec<_>>();
    assert_eq!(per_seed, runs);
    assert_ne!(runs[0], runs[1], "different seeds, different runs");

    // The summary: one row per strategy, the seeds named.
    let out = sim(&[&base[..], &["--seeds", "3"]].concat());
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("seeds 7..=9"), "{table}");
    assert_eq!(
        table
            .lines()
            .filter(|l| l.starts_with("none ") || l.starts_with("standard "))
            .count(),
        2,
        "{table}"
    );

    // One chart is one run.
    let out = sim(&[&base[..], &["--seeds", "3", "--svg", "/dev/null"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not go with --seeds"));
}
