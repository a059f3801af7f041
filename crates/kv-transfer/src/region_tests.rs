//! Tests of `region.rs`.

use super::*;

#[test]
fn host_region_is_aligned_zeroed_and_block_major() {
    let r = Region::host(8, 1000).unwrap();
    assert_eq!(r.base_address() % HOST_ALIGN as u64, 0);
    assert_eq!(r.len_bytes(), 8000);
    assert_eq!(r.memory_kind(), MemoryKind::Host);
    assert!(r.read_block(7).unwrap().iter().all(|&b| b == 0));
    r.write_block(3, &[3; 1000]).unwrap();
    assert_eq!(r.read_block(3).unwrap(), vec![3; 1000]);
    assert!(r.read_block(2).unwrap().iter().all(|&b| b == 0));
    assert!(r.read_block(4).unwrap().iter().all(|&b| b == 0));
    let mut g = r.lock_block(5).unwrap();
    g[0] = 9;
    drop(g);
    assert_eq!(r.read_block(5).unwrap()[0], 9);
}

#[test]
fn bad_arguments_are_typed_errors() {
    assert!(matches!(
        Region::host(0, 10),
        Err(TransferError::InvalidArgument(_))
    ));
    let r = Region::host(2, 16).unwrap();
    assert!(matches!(
        r.write_block(2, &[0; 16]),
        Err(TransferError::OutOfRange {
            block: 2,
            num_blocks: 2
        })
    ));
    assert!(matches!(
        r.write_block(0, &[0; 15]),
        Err(TransferError::BlockSize { .. })
    ));
    assert!(matches!(
        r.read_block_into(1, &mut [0; 17]),
        Err(TransferError::BlockSize { .. })
    ));
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_feature_is_unsupported() {
    assert!(matches!(
        Region::cuda(0, 4, 64),
        Err(TransferError::Unsupported(_))
    ));
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_region_or_typed_error() {
    match Region::cuda(0, 4, 64) {
        Ok(r) => {
            assert_eq!(r.memory_kind(), MemoryKind::Cuda);
            r.write_block(2, &[5; 64]).unwrap();
            assert_eq!(r.read_block(2).unwrap(), vec![5; 64]);
            assert!(matches!(
                r.lock_block(0),
                Err(TransferError::Unsupported(_))
            ));
        }
        Err(e) => assert!(matches!(e, TransferError::CudaUnavailable(_)), "{e}"),
    }
}

#[test]
fn copy_between_regions_and_onto_itself() {
    let a = Region::host(4, 32).unwrap();
    let b = Region::host(4, 32).unwrap();
    a.write_block(1, &[1; 32]).unwrap();
    b.copy_block_from(2, &a, 1).unwrap();
    assert_eq!(b.read_block(2).unwrap(), vec![1; 32]);
    a.copy_block_from(1, &a, 1).unwrap();
    a.copy_block_from(0, &a, 1).unwrap();
    assert_eq!(a.read_block(0).unwrap(), vec![1; 32]);
}

#[test]
fn lease_excludes_writers_until_dropped() {
    let r = Region::host(2, 8).unwrap();
    let lease = r.lease_block(0).unwrap();
    let r2 = Arc::clone(&r);
    let writer = std::thread::spawn(move || r2.write_block(0, &[7; 8]).unwrap());
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(lease.host_bytes().unwrap(), &[0; 8]);
    drop(lease);
    writer.join().unwrap();
    assert_eq!(r.read_block(0).unwrap(), vec![7; 8]);
}

/// A source block queued for sending (leased) is still readable by its owner: the
/// engine reads prefix blocks while a prefill worker's TCP batch holds them, and the
/// batch is only written after the engine's next step. With one exclusive lock both
/// waited on each other (a prefill worker hung under load).
#[test]
fn readers_share_a_leased_block_and_writers_wait_for_all() {
    let r = Region::host(2, 8).unwrap();
    r.write_block(1, &[3; 8]).unwrap();
    let lease = r.lease_block(1).unwrap();
    let second = r.lease_block(1).unwrap();
    // Same thread, lease held: would spin forever with an exclusive lease.
    assert_eq!(r.read_block(1).unwrap(), vec![3; 8]);
    assert_eq!(&*r.read_lock_block(1).unwrap(), &[3; 8]);
    let dst = Region::host(2, 8).unwrap();
    dst.copy_block_from(0, &r, 1).unwrap();
    assert_eq!(dst.read_block(0).unwrap(), vec![3; 8]);
    let r2 = Arc::clone(&r);
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || {
        r2.write_block(1, &[9; 8]).unwrap();
        tx.send(()).unwrap();
    });
    drop(lease);
    assert!(
        rx.recv_timeout(std::time::Duration::from_millis(50))
            .is_err(),
        "a writer went in while a reader held the block"
    );
    drop(second);
    rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    writer.join().unwrap();
    assert_eq!(r.read_block(1).unwrap(), vec![9; 8]);
}

#[test]
fn parts_of_blocks_are_written_copied_and_read_in_place() {
    let (a, b) = (Region::host(3, 64).unwrap(), Region::host(3, 64).unwrap());
    a.write_part(1, 16, &[7u8; 16]).unwrap();
    let block = a.read_block(1).unwrap();
    assert!(block[..16].iter().all(|&x| x == 0));
    assert!(block[16..32].iter().all(|&x| x == 7));
    assert!(block[32..].iter().all(|&x| x == 0));
    b.copy_part_from(2, &a, 1, 8..24).unwrap();
    let mut part = [0u8; 16];
    b.read_part_into(2, 8, &mut part).unwrap();
    assert_eq!(part[..8], [0; 8]);
    assert_eq!(part[8..], [7; 8]);
    // Out of the block, or of the region: typed errors, nothing written.
    assert!(matches!(
        a.write_part(0, 60, &[1u8; 8]),
        Err(TransferError::BadPart { .. })
    ));
    assert!(matches!(
        b.copy_part_from(0, &a, 0, 32..72),
        Err(TransferError::BadPart { .. })
    ));
    assert!(matches!(
        a.read_part_into(3, 0, &mut part),
        Err(TransferError::OutOfRange { .. })
    ));
    assert!(a.read_block(0).unwrap().iter().all(|&x| x == 0));
}
