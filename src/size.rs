//! `tandem size` (formerly `tandem plan`, still its alias): flags → the simulator's search for
//! the smallest cluster (`tandem_sim::plan`), then its table and JSON. Offline sizing from
//! simulated runs; `tandem planner` is the online autoscaler.

use anyhow::bail;
use clap::{Args, ValueEnum};
use tandem_sim::{DisaggMode, Topologies};

use crate::sim::SimArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TopologyArg {
    Aggregated,
    Disaggregated,
    Both,
}

#[derive(Args, Debug)]
pub struct SizeArgs {
    /// The load, the engine, the routing and the SLO, as for `tandem sim`. `--workers` is
    /// the largest cluster considered; `--disagg` the rule of the disaggregated candidates
    /// (`never` means `isl-bounding` here). With `--cascade-escalation-rate`, the large
    /// model's pool of a cascade is sized too (for the stream the cascade sends it, and, to
    /// compare, for a random share of the raw traffic).
    #[command(flatten)]
    sim: SimArgs,
    /// Which kinds of cluster to plan.
    #[arg(long, env = "TANDEM_PLAN_TOPOLOGIES", value_enum, default_value_t = TopologyArg::Both)]
    topologies: TopologyArg,
}

pub fn run(args: SizeArgs) -> anyhow::Result<()> {
    if args.sim.out.sweep_rate.is_some() || args.sim.out.plot_dir.is_some() {
        bail!("tandem size runs one load: --sweep-rate and --plot-dir are for tandem sim");
    }
    let mut base = args.sim.config()?;
    if base.routing.disagg.mode == DisaggMode::Never {
        base.routing.disagg.mode = DisaggMode::IslBounding;
    }
    let max_workers = base.topology.workers;
    let topologies = match args.topologies {
        TopologyArg::Aggregated => Topologies::Aggregated,
        TopologyArg::Disaggregated => Topologies::Disaggregated,
        TopologyArg::Both => Topologies::Both,
    };
    let plan = tandem_sim::plan(&base, max_workers, topologies)?;
    print!("{}", plan.to_markdown());
    // A cascade: its large model's pool, behind the smallest aggregated cluster found (the
    // largest considered where none meets the SLO), for the stream the cascade sends it.
    let cascade = match args.sim.cascade() {
        Some(cascade) => {
            let mut small = base.clone();
            small.topology.prefill_workers = 0;
            small.topology.workers = plan
                .aggregated
                .as_ref()
                .map_or(max_workers, |c| c.decode_workers);
            let size = tandem_sim::size_large_pool(&small, &cascade, max_workers)?;
            print!("{}", size.to_markdown());
            Some(size)
        }
        None => None,
    };
    if let Some(path) = &args.sim.out.json {
        match cascade {
            None => tandem_workload::plot::write_json(path, &plan)?,
            Some(cascade) => tandem_workload::plot::write_json(
                path,
                &serde_json::json!({"plan": plan, "cascade": cascade}),
            )?,
        }
    }
    Ok(())
}
