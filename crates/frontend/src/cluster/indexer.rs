//! The standalone indexer's gRPC service: `FindMatches` over a [`ClusterView`]'s index.

use std::sync::Arc;

use tandem_protocol::SequenceHash;
use tandem_protocol::grpc::{FindMatchesReply, FindMatchesRequest, WorkerOverlap, indexer_server};
use tonic::{Request, Response, Status};

use tandem_router::FedIndex;

use super::view::ClusterView;

/// Longest query accepted, in blocks (a 1M-token prompt of 16-token blocks).
const MAX_QUERY_BLOCKS: usize = 65_536;

/// `Indexer` over a fed index.
#[derive(Debug, Clone)]
pub struct IndexerService {
    view: Arc<ClusterView<FedIndex>>,
}

impl IndexerService {
    pub fn new(view: Arc<ClusterView<FedIndex>>) -> Self {
        IndexerService { view }
    }
}

#[tonic::async_trait]
impl indexer_server::Indexer for IndexerService {
    async fn find_matches(
        &self,
        request: Request<FindMatchesRequest>,
    ) -> Result<Response<FindMatchesReply>, Status> {
        let req = request.into_inner();
        if req.sequence_hashes.len() > MAX_QUERY_BLOCKS {
            return Err(Status::invalid_argument(format!(
                "{} blocks in one query; at most {MAX_QUERY_BLOCKS}",
                req.sequence_hashes.len()
            )));
        }
        let hashes: Vec<SequenceHash> = req.sequence_hashes.into_iter().map(SequenceHash).collect();
        let scores = self.view.find_matches(&hashes);
        let workers = scores
            .scores
            .into_iter()
            .map(|(w, c)| WorkerOverlap {
                worker_id: w.0,
                device: c.device,
                host: c.host,
                disk: c.disk,
            })
            .collect();
        Ok(Response::new(FindMatchesReply { workers }))
    }
}
