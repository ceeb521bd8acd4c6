//! `flotilla serve`: starts the coordinator. On sled it opens the store in the data directory
//! and leads from start to stop (`lead.rs`); on a shared PostgreSQL store it stands by and
//! leads while it holds the lease (`shared.rs`). Either way the optional embedded broker and
//! the coordinator key come first.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::service::broker::EmbeddedBroker;
use crate::service::config::Config;
use crate::service::config_store::StoreConfig;
use crate::service::error::ServiceError;
use crate::service::keys;
use crate::service::lead::lead;
use crate::service::leadership::Sole;
use crate::service::seal::{Seal, SealCheck};
use crate::service::shared;
use crate::service::store::Store;
use crate::service::store_health;

/// Runs the coordinator until `shutdown` is cancelled.
pub async fn serve(config: Config, shutdown: CancellationToken) -> Result<(), ServiceError> {
    let _broker = match config.broker.embedded {
        // The broker start polls its port with blocking connects; keep that off the runtime.
        Some(addr) => Some(
            tokio::task::spawn_blocking(move || EmbeddedBroker::start(addr))
                .await
                .map_err(|e| ServiceError::BrokerTask {
                    reason: e.to_string(),
                })??,
        ),
        None => None,
    };
    let key = keys::load_secret_key(&config.coordinator_key)?;
    match &config.store {
        StoreConfig::Sled => {
            let opening = std::time::Instant::now();
            let store = open_sled(&config)?;
            let me = Arc::new(Sole::new(config.broker.client_id.clone()));
            lead(&config, key, store, me, opening, None, shutdown).await
        }
        StoreConfig::Postgres(pg) => shared::serve_shared(&config, pg, key, shutdown).await,
    }
}

/// Opens the sled store in the data directory, releasing the disk reserve when the disk is
/// full, and refuses a store that lost acknowledged commits (its seal says so).
fn open_sled(config: &Config) -> Result<Store, ServiceError> {
    let db = config.data_dir.join("db");
    // sled writes while it opens; an open that runs out of space can leave the store unreadable.
    // Errors other than a full disk (a missing or unwritable directory) are left to the store's
    // own open, which names them.
    let _ = std::fs::create_dir_all(&config.data_dir);
    match store_health::has_room(&config.data_dir) {
        Err(e) if store_health::is_no_space(&e) => {
            if store_health::release_reserve(&config.data_dir) {
                tracing::warn!(data_dir = %config.data_dir.display(), error = %e,
                    "the disk is full: released the reserve so the store can open; the coordinator refuses changes until there is room");
            } else {
                return Err(ServiceError::NoRoom {
                    data_dir: config.data_dir.clone(),
                    reason: e.to_string(),
                });
            }
        }
        _ => {}
    }
    let store = Store::open(&db).map_err(|source| ServiceError::OpenStore {
        path: db.clone(),
        source,
    })?;
    store_health::ensure_reserve(&config.data_dir);
    match store.check_seal().map_err(ServiceError::Seal)? {
        SealCheck::Lost { stored, sealed } => {
            return Err(ServiceError::StoreLost {
                path: db.clone(),
                seal: Seal::for_store(&db).path().to_owned(),
                stored,
                sealed,
            })
        }
        SealCheck::Unsealed if store.generation() > 0 => {
            tracing::warn!(store = %db.display(), "the store's seal is missing: lost writes cannot be detected until the next write seals it again");
        }
        SealCheck::Unsealed | SealCheck::Intact => {}
    }
    Ok(store)
}
