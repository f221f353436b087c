// Asynchronous block I/O between CPU memory and one open file: a pool of threads doing
// pread/pwrite, one handle per request. Used by zerotune/memory/aio.py (SwapFile).
//
// [Note: aio requests]
// A request (one tensor, one file offset) is cut into blocks of `block_bytes`, and the
// blocks go into one FIFO queue per file. Each worker thread takes the next block and
// issues one blocking pread/pwrite for it, so at most `workers = min(threads, queue_depth)`
// blocks are in the kernel at once: that is the queue depth a psync pool can offer (it needs
// no libaio or liburing, which CI does not have). Requests submitted earlier finish earlier,
// which is what a prefetching caller wants.
//
// An urgent request (a small read something is blocked on right now, while the queue holds
// a pipeline's megabytes of read-ahead) goes in front of every block not started yet, behind
// the urgent blocks queued before it: it waits for the blocks already in the kernel only.
// It may so pass a queued write of the same bytes; the caller makes sure there is none.
//
// With O_DIRECT, file offsets, lengths and memory addresses must be multiples of 4096. The
// Python side checks offsets and addresses; a length that is not a multiple of 4096 leaves a
// tail of less than 4096 bytes, which goes through a per-worker aligned bounce page: a read
// fills only the tensor's bytes, a write pads the rest of the page with zeros. Without
// O_DIRECT the tail is read or written directly, exactly `nbytes`.
//
// Errors: a failing block records (errno, file offset, length, bytes got before EOF or -1);
// the other blocks still run, and of several failures the one at the lowest offset is kept,
// so the report does not depend on thread timing. wait() returns that record and Python
// raises an OSError subclass naming the file and the offset. An EOF (a read returning 0, or
// an O_DIRECT read returning a partial page) is reported as EIO.
//
// Memory ownership: the worker threads never touch Python objects and never hold the GIL.
// The Python side keeps each request's tensor alive until the request is done, and the
// file descriptor open until close() has drained the queue and joined the workers.

#include <torch/csrc/utils/pybind.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace zerotune_aio __attribute__((visibility("hidden"))) {

namespace py = pybind11;

constexpr int64_t kAlign = 4096;

struct Request {
  char* data;
  int64_t nbytes;
  int64_t offset;
  bool write;
  std::atomic<int64_t> pending{0};  // blocks not finished yet

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  bool finished = false;
  int err = 0;
  int64_t err_offset = 0;
  int64_t err_len = 0;
  int64_t err_got = -1;

  Request(char* d, int64_t n, int64_t off, bool w) : data(d), nbytes(n), offset(off), write(w) {}

  void fail(int e, int64_t off, int64_t len, int64_t got) {
    std::lock_guard<std::mutex> lk(mu);
    if (err != 0 && err_offset <= off) return;  // keep the failure at the lowest offset
    err = e;
    err_offset = off;
    err_len = len;
    err_got = got;
  }

  void finish_block() {
    if (pending.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lk(mu);
      finished = true;
      cv.notify_all();
    }
  }
};

struct Block {
  std::shared_ptr<Request> req;
  int64_t pos;  // offset inside the request
  int64_t len;
  bool bounce;  // an O_DIRECT tail shorter than a page: go through the bounce page
};

class Handle {
 public:
  explicit Handle(std::shared_ptr<Request> req) : req_(std::move(req)) {}

  // Blocks (without the GIL) until every block is done; returns None, or the error record
  // (errno, file offset, length, bytes got before EOF or -1).
  py::object wait() {
    int err;
    int64_t off, len, got;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lk(req_->mu);
      req_->cv.wait(lk, [&] { return req_->finished; });
      err = req_->err;
      off = req_->err_offset;
      len = req_->err_len;
      got = req_->err_got;
    }
    if (err == 0) return py::none();
    return py::make_tuple(err, off, len, got);
  }

  bool done() {
    std::lock_guard<std::mutex> lk(req_->mu);
    return req_->finished;
  }

 private:
  std::shared_ptr<Request> req_;
};

class Engine {
 public:
  Engine(int fd, bool direct, int64_t threads, int64_t block_bytes, int64_t queue_depth)
      : fd_(fd), direct_(direct), block_(block_bytes) {
    if (fd < 0) throw std::invalid_argument("aio: invalid file descriptor");
    if (threads < 1 || queue_depth < 1) {
      throw std::invalid_argument("aio: threads and queue_depth must be >= 1");
    }
    if (block_bytes < kAlign || block_bytes % kAlign != 0) {
      throw std::invalid_argument("aio: block_bytes must be a positive multiple of 4096");
    }
    int64_t n = std::min(threads, queue_depth);
    workers_.reserve(n);
    for (int64_t i = 0; i < n; ++i) workers_.emplace_back([this] { run(); });
  }

  ~Engine() { close(); }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Handle submit(bool write, const at::Tensor& tensor, int64_t offset, int64_t nbytes,
                bool urgent) {
    TORCH_CHECK(tensor.device().is_cpu(), "aio: the tensor must be on the CPU");
    TORCH_CHECK(tensor.is_contiguous(), "aio: the tensor must be contiguous");
    TORCH_CHECK(nbytes >= 0 && nbytes <= static_cast<int64_t>(tensor.nbytes()),
                "aio: nbytes out of range");
    TORCH_CHECK(offset >= 0, "aio: negative offset");
    char* data = static_cast<char*>(tensor.data_ptr());
    if (direct_) {
      TORCH_CHECK(offset % kAlign == 0 && reinterpret_cast<uintptr_t>(data) % kAlign == 0,
                  "aio: O_DIRECT needs 4096-aligned offsets and buffers");
    }
    auto req = std::make_shared<Request>(data, nbytes, offset, write);
    int64_t body = direct_ ? nbytes / kAlign * kAlign : nbytes;
    int64_t tail = nbytes - body;
    int64_t count = (body + block_ - 1) / block_ + (tail > 0 ? 1 : 0);
    if (count == 0) {
      req->finished = true;
      return Handle(req);
    }
    req->pending.store(count);
    {
      std::lock_guard<std::mutex> lk(mu_);
      TORCH_CHECK(!closed_, "aio: I/O on a closed file");
      std::vector<Block> blocks;
      blocks.reserve(count);
      for (int64_t pos = 0; pos < body; pos += block_) {
        blocks.push_back(Block{req, pos, std::min(block_, body - pos), false});
      }
      if (tail > 0) blocks.push_back(Block{req, body, tail, true});
      auto at = urgent ? queue_.begin() + urgent_ : queue_.end();
      queue_.insert(at, std::make_move_iterator(blocks.begin()),
                    std::make_move_iterator(blocks.end()));
      if (urgent) urgent_ += count;
    }
    if (count == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
    return Handle(req);
  }

  // Finishes every queued block, then stops the workers. The caller closes the fd.
  void close() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (closed_) return;
      closed_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

  int64_t workers() const { return static_cast<int64_t>(workers_.size()); }
  bool direct() const { return direct_; }

 private:
  void run() {
    void* page = nullptr;
    if (posix_memalign(&page, kAlign, kAlign) != 0) page = nullptr;
    for (;;) {
      Block b;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return closed_ || !queue_.empty(); });
        if (queue_.empty()) break;  // closed and drained
        b = std::move(queue_.front());
        queue_.pop_front();
        if (urgent_ > 0) --urgent_;
      }
      do_block(b, static_cast<char*>(page));
      b.req->finish_block();
    }
    std::free(page);
  }

  void do_block(const Block& b, char* page) {
    Request& r = *b.req;
    int64_t file_off = r.offset + b.pos;
    char* mem = r.data + b.pos;
    if (!b.bounce) {
      transfer(r, mem, b.len, file_off);
      return;
    }
    if (page == nullptr) {
      r.fail(ENOMEM, file_off, b.len, -1);
      return;
    }
    if (r.write) {
      std::memcpy(page, mem, b.len);
      std::memset(page + b.len, 0, kAlign - b.len);
      transfer(r, page, kAlign, file_off);
    } else if (transfer(r, page, kAlign, file_off)) {
      std::memcpy(mem, page, b.len);
    }
  }

  // One full pread/pwrite of `len` bytes, retried on EINTR and partial transfers.
  bool transfer(Request& r, char* mem, int64_t len, int64_t file_off) {
    int64_t done = 0;
    while (done < len) {
      ssize_t n = r.write ? ::pwrite(fd_, mem + done, len - done, file_off + done)
                          : ::pread(fd_, mem + done, len - done, file_off + done);
      if (n < 0) {
        if (errno == EINTR) continue;
        r.fail(errno, file_off, len, -1);
        return false;
      }
      if (n == 0) {  // EOF on a read; a write that makes no progress
        r.fail(r.write ? ENOSPC : EIO, file_off, len, r.write ? -1 : done);
        return false;
      }
      done += n;
      if (direct_ && done < len && done % kAlign != 0) {
        // O_DIRECT cannot continue from an unaligned position: the file ends here.
        r.fail(EIO, file_off, len, r.write ? -1 : done);
        return false;
      }
    }
    return true;
  }

  const int fd_;
  const bool direct_;
  const int64_t block_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Block> queue_;
  int64_t urgent_ = 0;  // the queue's first urgent_ blocks belong to urgent requests
  bool closed_ = false;
  std::vector<std::thread> workers_;
};

// [Note: lending storage]
// Gathered parameters live in one flat tensor per unit whose storage is emptied after use
// and refilled before the next one (autograd keeps views of that storage from forward to
// backward, so the unit must keep the same StorageImpl; see sharding/unit.py). Refilling it
// with resize_ asks malloc for fresh memory every time, and on the CPU fresh memory is
// page-faulted and zeroed by the kernel on first touch: 2-3 GB of faults per step for a
// 355M-parameter model. lend_storage points the unit's StorageImpl at a buffer the caller
// owns and reuses (already faulted, 4 KiB aligned so NVMe reads can land in it directly). The
// new DataPtr's context holds a reference to the buffer's storage, so the memory outlives
// any view that still uses it; resize_(0) on the unit's storage drops that reference.
void lend_storage(const at::Tensor& dst, const at::Tensor& src, int64_t nbytes) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "lend_storage: CPU tensors only");
  TORCH_CHECK(src.is_contiguous() && nbytes >= 0 &&
                  src.numel() * static_cast<int64_t>(src.element_size()) >= nbytes,
              "lend_storage: src must be contiguous and hold at least nbytes");
  c10::StorageImpl* impl = dst.storage().unsafeGetStorageImpl();
  TORCH_CHECK(impl != src.storage().unsafeGetStorageImpl(),
              "lend_storage: a storage cannot lend to itself");
  auto* keep = new c10::Storage(src.storage());
  impl->set_data_ptr_noswap(c10::DataPtr(
      src.data_ptr(), keep, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); },
      dst.device()));
  impl->set_nbytes(static_cast<size_t>(nbytes));
}

// csrc/aio/host_cache.cpp
bool host_cache_enable(int64_t budget, int64_t min_bytes);
void host_cache_disable();
std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> host_cache_stats();

}  // namespace zerotune_aio

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace za = zerotune_aio;
  m.doc() = "zerotune async file I/O: a pread/pwrite thread pool over one file descriptor";
  py::class_<za::Handle>(m, "Handle")
      .def("wait", &za::Handle::wait,
           "Wait (GIL released); None, or (errno, offset, length, got_before_eof or -1)")
      .def("done", &za::Handle::done);
  py::class_<za::Engine>(m, "Engine")
      .def(py::init<int, bool, int64_t, int64_t, int64_t>(), py::arg("fd"), py::arg("direct"),
           py::arg("threads"), py::arg("block_bytes"), py::arg("queue_depth"))
      .def("submit", &za::Engine::submit, py::arg("write"), py::arg("tensor"),
           py::arg("offset"), py::arg("nbytes"), py::arg("urgent") = false)
      .def("close", &za::Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("workers", &za::Engine::workers)
      .def_property_readonly("direct", &za::Engine::direct);
  m.def("align", [] { return za::kAlign; });
  m.def("lend_storage", &za::lend_storage, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        "Point dst's storage at src's memory (first nbytes), keeping src's storage alive");
  m.def("host_cache_enable", &za::host_cache_enable, py::arg("budget"), py::arg("min_bytes"),
        "Serve CPU allocations of min_bytes and more, keeping freed ones within budget bytes");
  m.def("host_cache_disable", &za::host_cache_disable,
        "Give back the kept buffers and restore the previous CPU allocator");
  m.def("host_cache_stats", &za::host_cache_stats,
        "(installed, budget, kept, peak kept, live bytes, hits, misses); peak and counts "
        "since installed");
}
