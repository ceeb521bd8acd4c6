//! `flotilla serve` (placeholder until the engine lands; replaced by the real service).

use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Why the service stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("the coordinator service is not built yet")]
    NotReady,
}

/// Runs the coordinator until `shutdown` is cancelled.
pub async fn serve(_config: Config, _shutdown: CancellationToken) -> Result<(), ServiceError> {
    Err(ServiceError::NotReady)
}
