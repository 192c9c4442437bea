//! Not modelled yet: `READY` is false, so an estimate of this family on the `pytorch` runtime
//! is refused (exit 2) before it gets here.

use super::common::Fam;
use crate::families::WanDims;
use crate::runtime::pytorch::stages::Stages;

pub const READY: bool = false;

pub fn stages(_f: &Fam, _d: &WanDims) -> Stages {
    Stages::default()
}
