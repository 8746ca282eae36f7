// The documents gpusnap answers with: the JSON of `--json`. The CLI prints them for a command
// run here (cli/documents.h gives their human form); the agent (src/agent) answers with the
// same documents, built by the same functions, so that `gpusnap --agent ...` prints exactly
// what the direct command prints.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"

namespace gpusnap::engine {

// `gpusnap checkpoint --json`; `notes` are what the engine told a person on the way.
nlohmann::json checkpoint_document(const CheckpointResult& result, bool leave_running,
                                   const std::vector<std::string>& notes);

// `gpusnap restore --json`.
nlohmann::json restore_document(const RestoreResult& result, const std::filesystem::path& artifact,
                                const std::vector<std::string>& notes);

// `gpusnap inspect --json`: the manifest, with the artifact's path and total size.
nlohmann::json inspect_document(const Artifact& artifact);

// `gpusnap list --json`: every artifact directly under `dir`, sorted by name. Hidden entries
// (staging directories) are skipped; one that cannot be opened is listed with its "error".
// Throws Error(kNotFound) when `dir` does not exist.
nlohmann::json list_document(const std::filesystem::path& dir);

}  // namespace gpusnap::engine
