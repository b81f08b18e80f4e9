//! The settings that take one of a fixed set of words: `model.dtype`, `devices.grad_sync`,
//! `debug.fail_stage` and `debug.fail_mode`. Each is an enum, read once when the configuration
//! is loaded; the words are the ones the TOML file holds (serde's names, [`Display`] and
//! [`FromStr`] agree on them).
//!
//! A word that is not one of the values is refused before the file is deserialised, with a
//! message naming the field and listing the values ([`check_choices`]); so is an entry of a
//! device list that is not a [`DeviceSpec`] ([`check_device_lists`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind};

use crate::runtime::DeviceSpec;

/// A setting that takes one of a fixed set of words.
pub trait Choice: Copy + Sized + 'static {
    /// The field, dotted (`model.dtype`).
    const FIELD: &'static str;
    /// Every value, in the order the message for a bad word lists them.
    const ALL: &'static [Self];
    /// The word for the value, as the TOML file holds it.
    fn as_str(self) -> &'static str;
}

/// A word that is not one of a setting's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config: {field} = {value:?} is not allowed (must be one of {allowed})")]
pub struct UnknownChoice {
    /// The field, dotted.
    pub field: &'static str,
    /// The word found.
    pub value: String,
    /// The values, comma-separated.
    pub allowed: String,
}

fn parse<T: Choice>(word: &str) -> Result<T, UnknownChoice> {
    T::ALL
        .iter()
        .copied()
        .find(|v| v.as_str() == word)
        .ok_or_else(|| UnknownChoice {
            field: T::FIELD,
            value: word.to_string(),
            allowed: T::ALL
                .iter()
                .map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Display and FromStr through [`Choice::as_str`] (Display pads, so widths apply).
macro_rules! choice_text {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl FromStr for $t {
            type Err = UnknownChoice;
            fn from_str(s: &str) -> Result<Self, UnknownChoice> {
                parse(s)
            }
        }
    )*};
}

choice_text!(Dtype, GradSync, FailStage, FailMode);

/// A compute dtype: `model.dtype` in the configuration and `--dtype` on the command line (where
/// the long names `float32`, `bfloat16` and `float16` are taken too). Training takes auto, f32 or
/// bf16 (the configuration refuses f16, which would need loss scaling); the commands that run a
/// model also take f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bf16 on a GPU, f32 on the CPU.
    #[default]
    Auto,
    #[value(alias = "float32")]
    F32,
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "float16")]
    F16,
}

impl Dtype {
    /// The tensor type on `device`.
    pub fn kind(self, device: Device) -> Kind {
        match self {
            Dtype::Auto if device.is_cuda() => Kind::BFloat16,
            Dtype::Auto | Dtype::F32 => Kind::Float,
            Dtype::Bf16 => Kind::BFloat16,
            Dtype::F16 => Kind::Half,
        }
    }
}

impl Choice for Dtype {
    const FIELD: &'static str = "model.dtype";
    /// The values the configuration takes (no f16: see [`Dtype`]).
    const ALL: &'static [Self] = &[Dtype::Auto, Dtype::F32, Dtype::Bf16];
    fn as_str(self) -> &'static str {
        match self {
            Dtype::Auto => "auto",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// `devices.grad_sync`: how the drafter replicas' gradients are summed and the new weights
/// handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradSync {
    /// NCCL when there are 2+ distinct CUDA drafter devices and libnccl loads; else copy.
    #[default]
    Auto,
    /// NCCL collectives between the GPUs (CUDA drafter devices only).
    Nccl,
    /// Tensor copies to and from the first drafter device (the reference, any devices).
    Copy,
}

impl Choice for GradSync {
    const FIELD: &'static str = "devices.grad_sync";
    const ALL: &'static [Self] = &[GradSync::Auto, GradSync::Nccl, GradSync::Copy];
    fn as_str(self) -> &'static str {
        match self {
            GradSync::Auto => "auto",
            GradSync::Nccl => "nccl",
            GradSync::Copy => "copy",
        }
    }
}

/// `debug.fail_stage`: the stage a `[debug]` fault is injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailStage {
    Loader,
    Target,
    #[default]
    Drafter,
    Checkpoint,
}

impl Choice for FailStage {
    const FIELD: &'static str = "debug.fail_stage";
    const ALL: &'static [Self] = &[
        FailStage::Loader,
        FailStage::Target,
        FailStage::Drafter,
        FailStage::Checkpoint,
    ];
    fn as_str(self) -> &'static str {
        match self {
            FailStage::Loader => "loader",
            FailStage::Target => "target",
            FailStage::Drafter => "drafter",
            FailStage::Checkpoint => "checkpoint",
        }
    }
}

/// `debug.fail_mode`: how the stage of `debug.fail_stage` fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailMode {
    /// Returns an error (a checkpoint: disk full).
    #[default]
    Error,
    /// Panics, as a libtorch error inside a tch call does.
    Panic,
    /// The checkpoint writer stops for good after the drafter is written.
    HoldDrafter,
    /// The checkpoint writer stops for good after the optimizer state is written.
    HoldOptimizer,
    /// The checkpoint writer stops for good before `latest` points at the new checkpoint.
    HoldRename,
}

impl FailMode {
    /// Whether the mode holds a checkpoint writer (the `hold-*` modes; checkpoint stage only).
    pub fn holds(self) -> bool {
        matches!(
            self,
            FailMode::HoldDrafter | FailMode::HoldOptimizer | FailMode::HoldRename
        )
    }
}

impl Choice for FailMode {
    const FIELD: &'static str = "debug.fail_mode";
    const ALL: &'static [Self] = &[
        FailMode::Error,
        FailMode::Panic,
        FailMode::HoldDrafter,
        FailMode::HoldOptimizer,
        FailMode::HoldRename,
    ];
    fn as_str(self) -> &'static str {
        match self {
            FailMode::Error => "error",
            FailMode::Panic => "panic",
            FailMode::HoldDrafter => "hold-drafter",
            FailMode::HoldOptimizer => "hold-optimizer",
            FailMode::HoldRename => "hold-rename",
        }
    }
}

/// The device lists of the parsed file (after the overrides): an entry that is not a
/// [`DeviceSpec`] word is refused naming the field and its index. A field that is not a list is
/// left to serde, which names it.
pub(super) fn check_device_lists(table: &toml::Table) -> anyhow::Result<()> {
    let Some(section) = table.get("devices") else {
        return Ok(());
    };
    for field in ["target_devices", "drafter_devices"] {
        let Some(toml::Value::Array(items)) = section.get(field) else {
            continue;
        };
        for (i, item) in items.iter().enumerate() {
            if item
                .as_str()
                .and_then(|w| w.parse::<DeviceSpec>().ok())
                .is_none()
            {
                anyhow::bail!(
                    "config: devices.{field}[{i}] = {item} is not a device (must be auto, cpu, cuda or cuda:N)"
                );
            }
        }
    }
    Ok(())
}

/// Checks the word of every [`Choice`] setting in the parsed file (after the overrides), in
/// section order, so that a bad word is refused with the legal values listed. A value that is
/// not a string is left to serde, which names the field and the file.
pub(super) fn check_choices(table: &toml::Table) -> Result<(), UnknownChoice> {
    check::<Dtype>(table)?;
    check::<GradSync>(table)?;
    check::<FailStage>(table)?;
    check::<FailMode>(table)
}

fn check<T: Choice>(table: &toml::Table) -> Result<(), UnknownChoice> {
    let Some((section, field)) = T::FIELD.split_once('.') else {
        return Ok(());
    };
    match table.get(section).and_then(|s| s.get(field)) {
        Some(toml::Value::String(word)) => parse::<T>(word).map(drop),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// serde's word, Display and FromStr agree for every value of `T`.
    fn words_agree<T>()
    where
        T: Choice + Serialize + for<'de> Deserialize<'de> + fmt::Display + FromStr + PartialEq,
        T: fmt::Debug,
        <T as FromStr>::Err: fmt::Debug,
    {
        for &v in T::ALL {
            let serde_word = toml::Value::try_from(v).unwrap();
            assert_eq!(serde_word.as_str(), Some(v.as_str()), "{v:?}");
            assert_eq!(v.to_string(), v.as_str());
            assert_eq!(v.as_str().parse::<T>().unwrap(), v);
            let back: T = serde_word.try_into().unwrap();
            assert_eq!(back, v);
        }
    }

    #[test]
    fn serde_display_and_from_str_use_the_same_words() {
        words_agree::<Dtype>();
        words_agree::<GradSync>();
        words_agree::<FailStage>();
        words_agree::<FailMode>();
        assert_eq!(format!("[{:>6}]", Dtype::F32), "[   f32]", "Display pads");
    }

    #[test]
    fn a_bad_word_names_the_field_and_the_values() {
        assert_eq!(
            "f16".parse::<Dtype>().unwrap_err().to_string(),
            "config: model.dtype = \"f16\" is not allowed (must be one of auto, f32, bf16)"
        );
        assert_eq!(
            "hold".parse::<FailMode>().unwrap_err().to_string(),
            "config: debug.fail_mode = \"hold\" is not allowed (must be one of error, panic, \
             hold-drafter, hold-optimizer, hold-rename)"
        );
        assert!(FailMode::HoldRename.holds() && !FailMode::Panic.holds());
    }

    /// The command line takes every dtype under its short and long names; auto is bf16 on a
    /// GPU and f32 on the CPU.
    #[test]
    fn dtypes_on_the_command_line_and_as_tensor_types() {
        use clap::ValueEnum;
        let parsed = |word: &str| <Dtype as ValueEnum>::from_str(word, false).unwrap();
        for (short, long, kind) in [
            ("f32", "float32", Kind::Float),
            ("bf16", "bfloat16", Kind::BFloat16),
            ("f16", "float16", Kind::Half),
        ] {
            assert_eq!(parsed(short), parsed(long));
            assert_eq!(parsed(short).as_str(), short);
            assert_eq!(parsed(short).kind(Device::Cpu), kind);
            assert_eq!(parsed(short).kind(Device::Cuda(0)), kind);
        }
        assert_eq!(parsed("auto").kind(Device::Cpu), Kind::Float);
        assert_eq!(parsed("auto").kind(Device::Cuda(1)), Kind::BFloat16);
        assert!(<Dtype as ValueEnum>::from_str("fp8", false).is_err());
    }
}
