//! Device memory through host staging, against an in-process master and real owners: objects
//! put from device-like memory (addresses that fault if read directly, explicit copies only) read
//! back exactly into other device memory and into host memory, across more than one staging
//! slice; a copy the device refuses fails that key alone. The same checks run on a real GPU
//! (feature `cuda`) where the machine has one.

use std::sync::Arc;

use mooncake_client::{
    device::{host_backed::HostBackedDevice, DeviceMemory, DeviceParts, DeviceRange},
    Code, ReplicateConfig,
};
use mooncake_tests::{payload, Cluster};

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_move_between_device_memory_and_the_store_through_staging() {
    let c = Cluster::start(&[256 << 20, 256 << 20]).await;
    let client = c.client().await;
    let dev = Arc::new(HostBackedDevice::new());
    // 40 objects of 1.5 MiB: 60 MiB, several staging slices each way.
    let n = 40;
    let size = 3 * MIB / 2;
    let keys: Vec<String> = (0..n).map(|i| format!("dev/{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    let src: Vec<DeviceRange> = keys
        .iter()
        .map(|k| {
            let ptr = dev.alloc(size);
            dev.copy_from_host(&payload(k, size), ptr).unwrap();
            DeviceRange { ptr, len: size }
        })
        .collect();
    let device: Arc<dyn DeviceMemory> = dev.clone();
    let one = |rs: &[DeviceRange]| -> Vec<DeviceParts> { rs.iter().map(|r| vec![*r]).collect() };
    let put = client
        .batch_put_from_device(
            &refs,
            &one(&src),
            device.clone(),
            &ReplicateConfig::default(),
        )
        .await;
    assert!(put.iter().all(|r| r.is_ok()), "{put:?}");
    // One staging buffer per slice of at most 16 MiB (10 objects), not one per object.
    let staged = dev.take_staging_sizes();
    assert_eq!(staged, vec![10 * size, 10 * size, 10 * size, 10 * size]);

    // Back into other device memory.
    let dst: Vec<DeviceRange> = (0..n)
        .map(|_| DeviceRange {
            ptr: dev.alloc(size),
            len: size,
        })
        .collect();
    let got = client
        .batch_get_into_device(&refs, &one(&dst), device.clone())
        .await;
    assert!(
        got.iter().all(|r| matches!(r, Ok(n) if *n == size)),
        "{got:?}"
    );
    assert_eq!(dev.take_staging_sizes(), vec![10 * size; 4]);
    for (k, d) in keys.iter().zip(&dst) {
        let mut out = vec![0u8; size];
        dev.copy_to_host(d.ptr, &mut out).unwrap();
        assert!(out == payload(k, size), "{k} read back wrong");
    }
    // And into host memory, as any other client would read them.
    let mut host = vec![0u8; size];
    assert_eq!(client.get(&keys[7], &mut host).await.unwrap(), size);
    assert!(host == payload(&keys[7], size));

    // A range the device does not hold fails its key only; a miss is the store's code.
    let bad = DeviceRange {
        ptr: 0x1000,
        len: 64,
    };
    let put = client
        .batch_put_from_device(
            &["dev/bad", "dev/good"],
            &one(&[bad, src[0]]),
            device.clone(),
            &ReplicateConfig::default(),
        )
        .await;
    assert_eq!(put[0].as_ref().unwrap_err().code(), Code::TransferFail);
    assert!(put[1].is_ok());
    let got = client
        .batch_get_into_device(
            &["dev/good", "dev/missing", "dev/0", "dev/1"],
            &one(&[
                dst[0],
                dst[1],
                DeviceRange {
                    ptr: 0x1000,
                    len: size,
                },
                bad,
            ]),
            device.clone(),
        )
        .await;
    assert_eq!(got[0].as_ref().unwrap(), &size);
    assert_eq!(got[1].as_ref().unwrap_err().code(), Code::ObjectNotFound);
    assert_eq!(
        got[2].as_ref().unwrap_err().code(),
        Code::TransferFail,
        "read, then refused by the device"
    );
    assert_eq!(
        got[3].as_ref().unwrap_err().code(),
        Code::InvalidParams,
        "staging smaller than the object"
    );
    let mismatched = client
        .batch_get_into_device(&["dev/0"], &[], device.clone())
        .await;
    assert_eq!(
        mismatched[0].as_ref().unwrap_err().code(),
        Code::InvalidParams
    );

    // A layer's K and V apart in device memory make one object, read back into two other
    // device buffers and as one value into host memory.
    let half = 300_001;
    let kv: Vec<DeviceParts> = (0..3)
        .map(|l| {
            let value = payload(&format!("dev/kv/{l}"), 2 * half);
            [&value[..half], &value[half..]]
                .iter()
                .map(|part| {
                    let ptr = dev.alloc(half);
                    dev.copy_from_host(part, ptr).unwrap();
                    DeviceRange { ptr, len: half }
                })
                .collect()
        })
        .collect();
    let names = ["dev/kv/0", "dev/kv/1", "dev/kv/2"];
    let put = client
        .batch_put_from_device(&names, &kv, device.clone(), &ReplicateConfig::default())
        .await;
    assert!(put.iter().all(|r| r.is_ok()), "{put:?}");
    let back: Vec<DeviceParts> = (0..3)
        .map(|_| {
            (0..2)
                .map(|_| DeviceRange {
                    ptr: dev.alloc(half),
                    len: half,
                })
                .collect()
        })
        .collect();
    let got = client.batch_get_into_device(&names, &back, device).await;
    assert!(
        got.iter().all(|r| matches!(r, Ok(n) if *n == 2 * half)),
        "{got:?}"
    );
    for (l, parts) in back.iter().enumerate() {
        let value = payload(&format!("dev/kv/{l}"), 2 * half);
        let mut out = vec![0u8; 2 * half];
        dev.copy_to_host(parts[0].ptr, &mut out[..half]).unwrap();
        dev.copy_to_host(parts[1].ptr, &mut out[half..]).unwrap();
        assert!(out == value, "layer {l} read back wrong");
        let mut host = vec![0u8; 2 * half];
        assert_eq!(client.get(names[l], &mut host).await.unwrap(), 2 * half);
        assert!(host == value);
    }
    c.shutdown().await;
}

/// With the `cuda` feature: no driver here means a clear error; with a GPU, host memory is not
/// taken for device memory.
#[cfg(feature = "cuda")]
#[test]
fn cuda_memory_opens_only_with_a_driver_and_knows_host_memory_is_not_its() {
    use mooncake_client::device::cuda::CudaMemory;
    match CudaMemory::open(0) {
        // No driver, or a driver without this GPU: the driver's own error.
        Err(e) => assert!(
            e.message.contains("no CUDA driver") || e.message.contains("CUDA_ERROR"),
            "{e}"
        ),
        Ok(gpu) => {
            let host = vec![0u8; 4096];
            assert!(!gpu.owns(host.as_ptr() as usize, host.len()));
        }
    }
}

/// A host-backed device whose copies to it take 100 ms each, and which notes when each began.
struct SlowDevice {
    inner: HostBackedDevice,
    copies_to_device: std::sync::Mutex<Vec<std::time::Instant>>,
}

impl DeviceMemory for SlowDevice {
    fn name(&self) -> &str {
        "slow"
    }
    fn owns(&self, ptr: usize, len: usize) -> bool {
        self.inner.owns(ptr, len)
    }
    fn copy_to_host(
        &self,
        src: usize,
        dst: &mut [u8],
    ) -> Result<(), mooncake_client::device::DeviceError> {
        self.inner.copy_to_host(src, dst)
    }
    fn copy_from_host(
        &self,
        src: &[u8],
        dst: usize,
    ) -> Result<(), mooncake_client::device::DeviceError> {
        self.copies_to_device
            .lock()
            .unwrap()
            .push(std::time::Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(100));
        self.inner.copy_from_host(src, dst)
    }
}

/// A device get dropped by its caller (a timeout) copies nothing more to the device once the
/// drop has returned: the caller may free that memory then. Before, the staging thread went on
/// copying every key it had read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_device_get_copies_nothing_to_the_device_after_the_drop() {
    let c = Cluster::start(&[64 << 20]).await;
    let client = c.client().await;
    let n = 8;
    let keys: Vec<String> = (0..n).map(|i| format!("slow/{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
    for k in &keys {
        client
            .put(k, &payload(k, MIB), &ReplicateConfig::default())
            .await
            .unwrap();
    }
    let dev = Arc::new(SlowDevice {
        inner: HostBackedDevice::new(),
        copies_to_device: Default::default(),
    });
    let dst: Vec<DeviceParts> = (0..n)
        .map(|_| {
            vec![DeviceRange {
                ptr: dev.inner.alloc(MIB),
                len: MIB,
            }]
        })
        .collect();
    let device: Arc<dyn DeviceMemory> = dev.clone();
    let get = client.batch_get_into_device(&refs, &dst, device);
    // Dropped once its first copy to the device began (however long the reads before took).
    let began = async {
        while dev.copies_to_device.lock().unwrap().is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        _ = get => panic!("8 copies of 100 ms ended before the first was seen"),
        seen = tokio::time::timeout(std::time::Duration::from_secs(30), began) => {
            seen.expect("no copy to the device began within 30 s");
        }
    }
    let dropped = std::time::Instant::now();
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let copies = dev.copies_to_device.lock().unwrap().clone();
    assert!(
        !copies.is_empty() && copies.len() < n,
        "{} copies",
        copies.len()
    );
    assert!(
        copies.iter().all(|at| *at < dropped),
        "a copy began after the drop returned"
    );
}
