//! `gem-share`: share one GPU between commands without Kubernetes (what Gemini's
//! launch-backend.py and launch-command.py did). `schd` starts gem-schd for a GPU with
//! sockets under a directory; `run` runs a command as a named client with the hook
//! preloaded and its socket directory wired in.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use gem_schd::launch::{HOOK_ENV, HOOK_NAME, hook_path, ld_preload, socket_template};

#[derive(Debug, Parser)]
#[command(
    name = "gem-share",
    version,
    about = "Share one GPU between commands (no Kubernetes)"
)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run gem-schd for one GPU, with sockets at <DIR>/<client>/<gpu>.sock.
    Schd {
        /// GPU UUID (`nvidia-smi -L` prints it).
        #[arg(long)]
        gpu: String,
        /// Resource-config file: first line N, then `ID REQUEST LIMIT GPU_MEM [CLASS]` lines;
        /// CLASS is `guaranteed` (the default) or `opportunistic` (given only the GPU time
        /// the guaranteed clients leave).
        #[arg(long)]
        config: PathBuf,
        /// Directory for the clients' sockets.
        #[arg(long)]
        dir: PathBuf,
        /// The gem-schd binary (default: next to gem-share, else on PATH).
        #[arg(long)]
        schd: Option<PathBuf>,
        /// More gem-schd options, after `--` (e.g. `-- --window-ms 5000`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Run a command as client NAME of the config, with the hook preloaded.
    Run {
        /// Client ID, as in the config.
        #[arg(long)]
        name: String,
        /// The directory given to `gem-share schd --dir`.
        #[arg(long)]
        dir: PathBuf,
        /// The hook library (default: $KUBESHARE_HOOK, else libgemhook.so.1 next to
        /// gem-share, else libgemhook.so there).
        #[arg(long)]
        hook: Option<PathBuf>,
        /// Unified-memory mode (docs/um.md) with this GPU-resident share, a Kubernetes
        /// quantity such as `8Gi`: the hook makes allocations managed memory and
        /// prefetches up to this much at each grant. The client's GPU_MEM in the
        /// resource-config is then its managed ceiling.
        #[arg(long, value_name = "QUANTITY", value_parser = parse_resident)]
        unified_resident: Option<u64>,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

fn main() -> Result<()> {
    let args = Args::parse();
    let exe = std::env::current_exe().ok();
    match args.cmd {
        Cmd::Schd {
            gpu,
            config,
            dir,
            schd,
            extra,
        } => {
            let schd = schd.unwrap_or_else(|| {
                exe.as_deref()
                    .and_then(|e| e.parent())
                    .map(|d| d.join("gem-schd"))
                    .filter(|p| p.exists())
                    .unwrap_or_else(|| PathBuf::from("gem-schd"))
            });
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let dir = dir
                .canonicalize()
                .with_context(|| format!("resolving {}", dir.display()))?;
            let err = Command::new(&schd)
                .arg("--gpu")
                .arg(&gpu)
                .arg("--config")
                .arg(&config)
                .arg("--socket-template")
                .arg(socket_template(&dir))
                .args(&extra)
                .exec();
            Err(err).with_context(|| format!("starting {}", schd.display()))
        }
        Cmd::Run {
            name,
            dir,
            hook,
            unified_resident,
            command,
        } => {
            if !kubeshare_api::resource_config::is_valid_id(&name) {
                bail!(
                    "{name:?} is not a valid client ID (printable ASCII, no '/', at most 253 bytes)"
                );
            }
            let env_hook = std::env::var(HOOK_ENV).ok();
            let hook = hook_path(
                hook.as_deref(),
                env_hook.as_deref(),
                exe.as_deref(),
                Path::exists,
            )
            .with_context(|| format!("cannot locate {HOOK_NAME}; pass --hook or set {HOOK_ENV}"))?;
            if !hook.exists() {
                bail!(
                    "hook library {} does not exist; pass --hook or set {HOOK_ENV}",
                    hook.display()
                );
            }
            let hook = hook
                .canonicalize()
                .with_context(|| format!("resolving {}", hook.display()))?;
            let dir = dir.canonicalize().with_context(|| {
                format!(
                    "{} does not exist; start `gem-share schd --dir` first",
                    dir.display()
                )
            })?;
            let sockets = dir.join(&name);
            if !sockets.is_dir() {
                eprintln!(
                    "gem-share: warning: {} does not exist yet (is {name:?} in gem-schd's config?)",
                    sockets.display()
                );
            }
            let existing = std::env::var("LD_PRELOAD").ok();
            let preload = ld_preload(existing.as_deref(), &hook.to_string_lossy());
            let (prog, rest) = command.split_first().context("no command given")?;
            let mut cmd = Command::new(prog);
            cmd.args(rest)
                .env("LD_PRELOAD", preload)
                .env(gem_proto::SOCKET_DIR_ENV, &sockets);
            if let Some(bytes) = unified_resident {
                cmd.env(kubeshare_api::um::HOOK_UM_ENV, "1")
                    .env(kubeshare_api::um::HOOK_UM_RESIDENT_ENV, bytes.to_string());
            }
            let err = cmd.exec();
            Err(err).with_context(|| format!("running {prog}"))
        }
    }
}

/// `--unified-resident`: a positive byte quantity.
fn parse_resident(s: &str) -> Result<u64, String> {
    match kubeshare_api::parse_bytes(s) {
        Ok(0) => Err("must be above 0".into()),
        Ok(b) => Ok(b),
        Err(e) => Err(e.to_string()),
    }
}
