//! Where this process stands in a multi-process run, from the launcher's environment:
//! torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`) or, without them, Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NTASKS_PER_NODE`; `MASTER_ADDR` from the environment or the first host of
//! `SLURM_JOB_NODELIST`, `MASTER_PORT` from the environment or 29500).

use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The port rank 0's store listens on under Slurm when `MASTER_PORT` is not set (torchrun's
/// default too).
pub const DEFAULT_PORT: u16 = 29500;
/// Seconds a rank waits for the others (rendezvous, a collective, the store) before it gives
/// up; `DFLASH_DIST_TIMEOUT_S` overrides it.
pub const DEFAULT_TIMEOUT_S: f64 = 120.0;
pub const TIMEOUT_ENV: &str = "DFLASH_DIST_TIMEOUT_S";

/// Which launcher's variables the settings came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
}

/// This process's place in the run.
#[derive(Debug, Clone, PartialEq)]
pub struct DistSettings {
    pub launcher: Launcher,
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub local_world: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// How long a rank waits for the others (see [`DEFAULT_TIMEOUT_S`]).
    pub timeout: Duration,
}

impl DistSettings {
    /// The settings from the environment read through `get`; `None` when no launcher set any
    /// (a plain single-process run). Slurm's variables count only for a step of 2+ tasks
    /// (`srun -n 1`, or a job script run outside `srun`, stays a plain run).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistSettings>> {
        let timeout = timeout(&get)?;
        if get("WORLD_SIZE").is_some() {
            return torchrun(&get, timeout).map(Some);
        }
        match (get("SLURM_PROCID"), get("SLURM_NTASKS")) {
            (Some(_), Some(n)) if number(&n, "SLURM_NTASKS")? > 1 => slurm(&get, timeout).map(Some),
            _ => Ok(None),
        }
    }

    /// "rank 1 of 3 (torchrun, local rank 1 of 3, store at 127.0.0.1:29500)"
    pub fn describe(&self) -> String {
        let launcher = match self.launcher {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
        };
        format!(
            "rank {} of {} ({launcher}, local rank {} of {}, store at {}:{})",
            self.rank,
            self.world,
            self.local_rank,
            self.local_world,
            self.master_addr,
            self.master_port
        )
    }
}

fn required(get: &impl Fn(&str) -> Option<String>, name: &str) -> Result<String> {
    get(name).with_context(|| format!("{name} is not set (the launcher sets it)"))
}

fn number(value: &str, name: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .with_context(|| format!("{name} = {value:?} is not a whole number"))
}

fn port(value: &str, name: &str) -> Result<u16> {
    match value.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => bail!("{name} = {value:?} is not a port (1..=65535)"),
    }
}

fn timeout(get: &impl Fn(&str) -> Option<String>) -> Result<Duration> {
    let Some(v) = get(TIMEOUT_ENV) else {
        return Ok(Duration::from_secs_f64(DEFAULT_TIMEOUT_S));
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => Ok(Duration::from_secs_f64(s)),
        _ => bail!("{TIMEOUT_ENV} = {v:?} is not a number of seconds in (0, 86400]"),
    }
}

fn checked(s: DistSettings) -> Result<DistSettings> {
    if s.world == 0 {
        bail!("the world size is 0");
    }
    if s.rank >= s.world {
        bail!("rank {} is not below the world size {}", s.rank, s.world);
    }
    if s.master_addr.trim().is_empty() {
        bail!("MASTER_ADDR is empty");
    }
    Ok(s)
}

fn torchrun(get: &impl Fn(&str) -> Option<String>, timeout: Duration) -> Result<DistSettings> {
    let num = |name: &str, default: Option<usize>| -> Result<usize> {
        match (get(name), default) {
            (Some(v), _) => number(&v, name),
            (None, Some(d)) => Ok(d),
            (None, None) => required(get, name).map(|_| 0),
        }
    };
    checked(DistSettings {
        launcher: Launcher::Torchrun,
        rank: num("RANK", None)?,
        world: num("WORLD_SIZE", None)?,
        local_rank: num("LOCAL_RANK", Some(0))?,
        local_world: num("LOCAL_WORLD_SIZE", Some(1))?,
        master_addr: required(get, "MASTER_ADDR")?,
        master_port: port(&required(get, "MASTER_PORT")?, "MASTER_PORT")?,
        timeout,
    })
}

fn slurm(get: &impl Fn(&str) -> Option<String>, timeout: Duration) -> Result<DistSettings> {
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a,
        None => {
            let list =
                required(get, "SLURM_JOB_NODELIST").context("MASTER_ADDR is not set either")?;
            first_host(&list)
                .with_context(|| format!("SLURM_JOB_NODELIST = {list:?} names no host"))?
        }
    };
    let master_port = match get("MASTER_PORT") {
        Some(p) => port(&p, "MASTER_PORT")?,
        None => DEFAULT_PORT,
    };
    // SLURM_NTASKS_PER_NODE may read "2(x3)" on uneven layouts: the count before it is taken.
    let local_world = get("SLURM_NTASKS_PER_NODE")
        .and_then(|v| v.split(['(', ',']).next()?.trim().parse().ok())
        .unwrap_or(1);
    checked(DistSettings {
        launcher: Launcher::Slurm,
        rank: number(&required(get, "SLURM_PROCID")?, "SLURM_PROCID")?,
        world: number(&required(get, "SLURM_NTASKS")?, "SLURM_NTASKS")?,
        local_rank: get("SLURM_LOCALID")
            .map(|v| number(&v, "SLURM_LOCALID"))
            .transpose()?
            .unwrap_or(0),
        local_world,
        master_addr,
        master_port,
        timeout,
    })
}

/// The first host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03".
pub fn first_host(list: &str) -> Option<String> {
    let first = list.split(',').next()?.trim();
    let host = match first.split_once('[') {
        None => first.to_string(),
        Some((prefix, rest)) => {
            let range = rest.split([',', ']']).next()?;
            let start = range.split('-').next()?;
            let suffix = list
                .split_once(']')
                .map(|(_, s)| s.split(',').next().unwrap_or(""))
                .unwrap_or("");
            format!("{prefix}{start}{suffix}")
        }
    };
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_variables_give_the_rank_and_the_store() {
        let s = DistSettings::from_env(env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29400"),
            (TIMEOUT_ENV, "30"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.rank, s.world, s.local_rank, s.local_world), (2, 4, 0, 2));
        assert_eq!((s.master_addr.as_str(), s.master_port), ("node7", 29400));
        assert_eq!(s.timeout, Duration::from_secs(30));
        assert_eq!(s.launcher, Launcher::Torchrun);
    }

    #[test]
    fn no_launcher_is_a_plain_run_and_bad_values_name_the_variable() {
        assert_eq!(DistSettings::from_env(env(&[])).unwrap(), None);
        assert_eq!(
            DistSettings::from_env(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])).unwrap(),
            None
        );
        let err = |pairs: &[(&str, &str)]| {
            format!("{:#}", DistSettings::from_env(env(pairs)).unwrap_err())
        };
        let e = err(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "h")]);
        assert!(e.contains("MASTER_PORT is not set"), "{e}");
        let e = err(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "x"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(e.contains("RANK = \"x\""), "{e}");
        let e = err(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(e.contains("rank 2 is not below the world size 2"), "{e}");
        let e = err(&[(TIMEOUT_ENV, "-1")]);
        assert!(e.contains(TIMEOUT_ENV), "{e}");
    }

    #[test]
    fn slurm_variables_and_the_first_node_as_the_store_host() {
        let s = DistSettings::from_env(env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[03-04],cpu1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.rank, s.world, s.local_rank, s.local_world), (3, 4, 1, 2));
        assert_eq!(
            (s.master_addr.as_str(), s.master_port),
            ("gpu03", DEFAULT_PORT)
        );
        assert_eq!(first_host("a1,a2").as_deref(), Some("a1"));
        assert_eq!(first_host("n[7,9]-ib").as_deref(), Some("n7-ib"));
        assert_eq!(first_host(""), None);
    }
}
