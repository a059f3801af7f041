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
    /// (`never` means `isl-bounding` here).
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
    if let Some(path) = &args.sim.out.json {
        tandem_workload::plot::write_json(path, &plan)?;
    }
    Ok(())
}
