// A C++ CUDA program with cuBLAS for gpusnap's GPU tests (docs/compatibility.md): two matrices
// made on the GPU, their product by cublasSgemm kept as the answer on the host, then line commands
// on TCP 127.0.0.1 (--port, 0: any):
//   CHECK -> "OK max_err=0 pid=<pid>" when the product computed again from the matrices still on
//            the GPU equals the answer bit for bit, else "FAIL mismatches=<n>"
//   QUIT  -> "BYE"
// --ready-file PATH receives the port once the answer is computed.
#include <arpa/inet.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK_CUDA(x)                                              \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)
#define CHECK_BLAS(x)                                             \
  do {                                                            \
    cublasStatus_t s = (x);                                       \
    if (s != CUBLAS_STATUS_SUCCESS) {                             \
      std::fprintf(stderr, "%s: cuBLAS status %d\n", #x, (int)s); \
      std::exit(1);                                               \
    }                                                             \
  } while (0)

__global__ void fill(float* p, size_t n, unsigned seed) {
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    p[i] = static_cast<float>(h & 0xffff) / 65536.0f - 0.5f;
  }
}

int main(int argc, char** argv) {
  int port = 0, dim = 2048;
  const char* ready_file = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--port")) port = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--dim")) dim = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--ready-file")) ready_file = argv[i + 1];
  }
  const size_t n = static_cast<size_t>(dim) * dim;
  float *a, *b, *c;
  CHECK_CUDA(cudaMalloc(&a, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&b, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&c, n * sizeof(float)));
  fill<<<(n + 255) / 256, 256>>>(a, n, 1);
  fill<<<(n + 255) / 256, 256>>>(b, n, 2);
  cublasHandle_t blas;
  CHECK_BLAS(cublasCreate(&blas));
  const float one = 1.0f, zero = 0.0f;
  auto product = [&](std::vector<float>& out) {
    CHECK_BLAS(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &one, a, dim, b, dim,
                           &zero, c, dim));
    out.resize(n);
    CHECK_CUDA(cudaMemcpy(out.data(), c, n * sizeof(float), cudaMemcpyDeviceToHost));
  };
  std::vector<float> reference, now;
  product(reference);

  int srv = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int on = 1;
  ::setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(srv, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(srv, 16) != 0) {
    std::perror("bind");
    return 1;
  }
  socklen_t len = sizeof addr;
  ::getsockname(srv, reinterpret_cast<sockaddr*>(&addr), &len);
  if (ready_file != nullptr) {
    std::string tmp = std::string(ready_file) + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    std::fprintf(f, "%d\n", ntohs(addr.sin_port));
    std::fclose(f);
    std::rename(tmp.c_str(), ready_file);
  }
  for (;;) {
    int conn = ::accept4(srv, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    FILE* io = ::fdopen(conn, "r+");
    char line[256];
    while (std::fgets(line, sizeof line, io) != nullptr) {
      std::string cmd(line);
      while (!cmd.empty() && (cmd.back() == '\n' || cmd.back() == '\r')) cmd.pop_back();
      std::string reply;
      if (cmd == "CHECK") {
        product(now);
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i)
          bad += std::memcmp(&now[i], &reference[i], sizeof(float)) != 0;
        reply = bad == 0 ? "OK max_err=0 pid=" + std::to_string(::getpid())
                         : "FAIL mismatches=" + std::to_string(bad);
      } else if (cmd == "QUIT") {
        std::fputs("BYE\n", io);
        std::fflush(io);
        return 0;
      } else {
        reply = "ERR unknown command";
      }
      std::fputs((reply + "\n").c_str(), io);
      std::fflush(io);
    }
    std::fclose(io);
  }
}
