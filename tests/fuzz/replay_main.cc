// The default suite's side of a fuzz target: its entry point, built by the main build with the
// project's compiler and no libFuzzer, fed every file of its committed corpus once, in name
// order. Deterministic and quick, so every `scripts/test` run re-checks each input the fuzzer
// ever kept (a crash found once stays fixed); finding new inputs is tests/fuzz/run's work.
//   fuzz_TARGET_replay CORPUS_DIR...
// Fails on a folder that is missing or empty: a replay of nothing would pass whatever broke.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR...\n", argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path dir = argv[i];
    std::error_code ec;
    std::vector<std::filesystem::path> inputs;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      if (e.is_regular_file()) inputs.push_back(e.path());
    }
    if (ec || inputs.empty()) {
      std::fprintf(stderr, "%s: no corpus files in %s\n", argv[0], dir.c_str());
      return 1;
    }
    std::sort(inputs.begin(), inputs.end());
    for (const auto& input : inputs) {
      std::ifstream in(input, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) {
        std::fprintf(stderr, "%s: cannot read %s\n", argv[0], input.c_str());
        return 1;
      }
      // Printed first, so that the input that crashes is the last line of the output.
      std::printf("%s (%zu bytes)\n", input.filename().c_str(), bytes.size());
      std::fflush(stdout);
      (void)LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    }
    std::printf("%zu inputs of %s: no crash\n", inputs.size(), dir.c_str());
  }
  return 0;
}
