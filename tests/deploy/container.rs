//! The container build: the image root and the Containerfile's final stage.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use super::*;

#[test]
fn container_root_runs_the_binary_and_buildah_builds_the_image() {
    let dir = common::temp_dir("deploy-container");
    let stage = dir.join("stage");
    let rootfs = stage.join("rootfs");
    let bin = env!("CARGO_BIN_EXE_tandem");
    output(
        Command::new("bash")
            .arg(deploy().join("container/build.sh"))
            .args(["--binary", bin, "--out"])
            .arg(&rootfs),
        "deploy/container/build.sh",
    );
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let tandem = rootfs.join("usr/local/bin/tandem");
    assert!(
        tandem.metadata().unwrap().permissions().mode() & 0o111 != 0,
        "not executable"
    );
    let passwd = std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(
        passwd
            .lines()
            .any(|l| l.starts_with("tandem:x:65532:65532:")),
        "{passwd}"
    );
    assert_eq!(
        rootfs.join("tmp").metadata().unwrap().permissions().mode() & 0o7777,
        0o1777
    );
    assert!(
        !rootfs.join("bin/sh").exists(),
        "the image root should hold no shell"
    );
    let root = rustix::process::geteuid().is_root();
    if !root {
        eprintln!("not root: skipping the chroot and buildah checks (CI runs as root)");
        return;
    }
    assert_eq!(rootfs.join("home/tandem").metadata().unwrap().uid(), 65532);
    let version = |root: &Path| {
        output(
            Command::new("chroot")
                .arg(root)
                .args(["/usr/local/bin/tandem", "--version"]),
            "tandem in the image root",
        )
    };
    assert_eq!(
        version(&rootfs).trim(),
        format!("tandem {}", env!("CARGO_PKG_VERSION"))
    );

    // The Containerfile's final stage, with the build stage replaced by the layout above.
    let storage = dir.join("storage");
    let buildah = || {
        let mut c = Command::new("buildah");
        c.arg("--root")
            .arg(storage.join("root"))
            .arg("--runroot")
            .arg(storage.join("run"));
        c.args(["--storage-driver", "vfs"]);
        c
    };
    let image = "localhost/tandem-deploy-test:dev";
    output(
        buildah()
            .args(["bud", "--pull-never", "--build-context"])
            .arg(format!("build={}", stage.display()))
            .arg("-f")
            .arg(deploy().join("container/Containerfile"))
            .args(["-t", image])
            .arg(&dir),
        "buildah bud",
    );
    let inspect: Value = serde_json::from_str(&output(
        buildah().args(["inspect", "--type", "image", image]),
        "buildah inspect",
    ))
    .unwrap();
    let config = &inspect["OCIv1"]["config"];
    assert_eq!(config["User"], "65532:65532");
    assert_eq!(config["Entrypoint"], json!(["/usr/local/bin/tandem"]));
    let ctr = output(
        buildah().args(["from", "--pull-never", image]),
        "buildah from",
    )
    .trim()
    .to_string();
    let mnt = PathBuf::from(output(buildah().args(["mount", &ctr]), "buildah mount").trim());
    let in_image = std::panic::catch_unwind(|| {
        assert_eq!(
            version(&mnt).trim(),
            format!("tandem {}", env!("CARGO_PKG_VERSION"))
        );
        assert!(
            !mnt.join("bin/sh").exists(),
            "the image should hold no shell"
        );
    });
    let _ = buildah().args(["umount", &ctr]).output();
    let _ = buildah().args(["rm", &ctr]).output();
    let _ = buildah().args(["rmi", "-f", image]).output();
    if let Err(e) = in_image {
        std::panic::resume_unwind(e);
    }
}
