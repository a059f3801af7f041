//! Every flag and variable deploy/ uses is one `tandem <role> --help` documents.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use super::*;

/// What `tandem <role> --help` documents: its flags and its environment variables.
fn documented(role: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let help = output(
        Command::new(env!("CARGO_BIN_EXE_tandem")).args([role, "--help"]),
        "tandem --help",
    );
    let mut flags = BTreeSet::new();
    let mut envs = BTreeSet::new();
    for line in help.lines() {
        let line = line.trim_start();
        if line.starts_with('-') {
            for w in line.split([' ', ',']) {
                if let Some(f) = w.strip_prefix("--") {
                    flags.insert(f.to_string());
                }
            }
        }
        let mut rest = line;
        while let Some(i) = rest.find("[env: ") {
            rest = &rest[i + 6..];
            let end = rest.find(['=', ']']).expect("[env: NAME=] or [env: NAME]");
            envs.insert(rest[..end].to_string());
        }
    }
    assert!(
        envs.len() > 10 && flags.len() > 10,
        "tandem {role} --help lists too little:\n{help}"
    );
    (flags, envs)
}

/// `TANDEM_*` names in a text (an env file, a script).
fn tandem_vars(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("TANDEM_") && w.len() > 7)
        .map(String::from)
        .collect()
}

#[test]
fn every_flag_and_variable_is_documented() {
    let docs: BTreeMap<&str, _> = ROLES.iter().map(|r| (*r, documented(r))).collect();
    let check = |roles: &[&str], vars: &BTreeSet<String>, from: &str| {
        for v in vars {
            for r in roles {
                assert!(
                    docs[r].1.contains(v),
                    "{from}: {v} is not documented by `tandem {r} --help`"
                );
            }
        }
    };
    // Env files: cluster-wide ones hold what every deployed role takes (the manifests run no
    // standalone indexer); the others, one role's.
    for (file, roles) in [
        ("base/cluster.env", &["frontend", "prefill", "decode"][..]),
        ("base/frontend.env", &["frontend"]),
        ("base/prefill.env", &["prefill"]),
        ("base/decode.env", &["decode"]),
        (
            "components/existing-etcd-nats/external.env",
            &["frontend", "prefill", "decode"],
        ),
        (
            "components/vllm/model.env",
            &["frontend", "prefill", "decode"],
        ),
        ("components/vllm/frontend.env", &["frontend"]),
        ("components/vllm/engine.env", &["prefill", "decode"]),
    ] {
        let text = std::fs::read_to_string(deploy().join(file)).unwrap();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            let (k, _) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{file}: {line:?} is not KEY=VALUE"));
            assert!(k.starts_with("TANDEM_"), "{file}: {k}");
        }
        check(roles, &tandem_vars(&text), file);
    }
    // The rendered pods: each tandem container's variables and flags, for its subcommand.
    let mut checked = 0;
    let scratch = common::temp_dir("deploy-renders-flags");
    for (label, path) in renders(&scratch) {
        let rendered = yaml_docs(&kustomize(&path));
        for (workload, pod) in pods(&rendered) {
            for c in pod["spec"]["containers"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| is_tandem(c))
            {
                let args: Vec<&str> = c["args"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap())
                    .collect();
                let role = args[0];
                assert!(
                    ROLES.contains(&role),
                    "{label}: {workload} runs `tandem {role}`"
                );
                let vars: BTreeSet<String> = environment(&rendered, c)
                    .into_keys()
                    .filter(|k| k.starts_with("TANDEM_"))
                    .collect();
                check(&[role], &vars, &format!("{label}: {workload}"));
                for a in &args[1..] {
                    let flag = a.strip_prefix("--").map(|f| f.split('=').next().unwrap());
                    let flag =
                        flag.unwrap_or_else(|| panic!("{label}: {workload}: argument {a:?}"));
                    assert!(
                        docs[role].0.contains(flag),
                        "{label}: {workload}: --{flag} is not a `tandem {role}` flag"
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "only {checked} tandem containers checked");
    // deploy/local: every variable it sets is one of the roles it starts.
    let script = std::fs::read_to_string(deploy().join("local/run.sh")).unwrap();
    for v in tandem_vars(&script) {
        assert!(
            docs.values().any(|(_, e)| e.contains(&v)),
            "deploy/local/run.sh: {v} is no tandem variable"
        );
    }
}
