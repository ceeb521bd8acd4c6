//! # flotilla-coordinator
//!
//! The coordinator service and the `flotilla` command line. It turns a rollout spec into ordered
//! groups of devices, publishes signed desired actions over MQTT, serves artifact blocks, and
//! advances, pauses or stops each rollout from the devices' readiness reports.
//!
//! Layout:
//! - Rollout logic, free of I/O: [`spec`] (the TOML rollout spec), [`selector`] (label
//!   selectors), [`planner`] (spec + fleet -> groups, conditions), [`engine`] (the state machine
//!   driven by reports, commands and ticks), [`store`] (sled persistence of rollouts).
//! - The service around it: [`config`], [`service`] (`flotilla serve`), [`mqtt`] (the MQTT link),
//!   [`artifacts`] (block server), [`releases`] (signed manifests, content-addressed artifacts),
//!   [`keys`], [`broker`] (embedded rumqttd), [`client`] (control requests over MQTT),
//!   [`view`] (tables and progress bars), [`demo`] (`flotilla demo`), [`cli`].

pub mod artifacts;
pub mod broker;
pub mod cli;
pub mod client;
pub mod conditions;
pub mod config;
pub mod demo;
pub mod engine;
pub mod fleetfile;
pub mod keys;
pub mod mqtt;
pub mod plan;
pub mod planner;
pub mod ramp;
pub mod releases;
pub mod selector;
pub mod service;
pub mod simulate;
pub mod spec;
pub mod store;
pub mod view;
pub mod window;
