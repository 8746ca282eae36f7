// The tier's folder format (src/tier/folder_format.h) for the test stand-in of the tier
// (tier_standin.py), so that the stand-in names its files and writes its index with the format's
// own code instead of a copy of it:
//   tier-folder-tool drain-file PID K                   prints PID-wK.img
//   tier-folder-tool index DIR PID GPU-UUID FILE...    writes DIR/PID.json for FILE... (their
//                                                      sizes, all of it on GPU-UUID)
// Built static: the stand-in runs it inside test containers whose root holds little else.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "tier/folder_format.h"

namespace folder = gpusnap::tier::folder;

int main(int argc, char** argv) {
  try {
    const std::string what = argc > 1 ? argv[1] : "";
    if (what == "drain-file" && argc == 4) {
      std::printf("%s\n",
                  folder::drain_file_name(std::stoull(argv[2]), std::stoull(argv[3])).c_str());
      return 0;
    }
    if (what == "index" && argc >= 5) {
      const std::filesystem::path dir = argv[2];
      folder::TierIndex index;
      index.pid = std::stoull(argv[3]);
      for (int i = 5; i < argc; ++i) {
        const std::uint64_t size = std::filesystem::file_size(dir / argv[i]);
        index.files.push_back({argv[i], size});
        index.bytes += size;
      }
      index.gpus.push_back({argv[4], index.bytes});
      folder::write_index(dir, index);
      return 0;
    }
    std::fprintf(stderr,
                 "usage: tier-folder-tool drain-file PID K | index DIR PID GPU-UUID FILE...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tier-folder-tool: %s\n", e.what());
    return 1;
  }
}
