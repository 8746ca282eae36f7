#include "container/build_id.h"

#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace gpusnap::container {

namespace {

// Exactly `size` bytes at `offset`, or false.
bool read_at(int fd, void* out, size_t size, uint64_t offset) {
  auto* p = static_cast<char*>(out);
  while (size > 0) {
    const ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

// [offset, offset + length) lies within a file of `file_size` bytes (no overflow).
bool within(uint64_t offset, uint64_t length, uint64_t file_size) {
  return offset <= file_size && length <= file_size - offset;
}

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The build-id among the notes of one PT_NOTE segment's bytes.
std::optional<std::string> build_id_in(const std::vector<unsigned char>& notes, uint64_t align) {
  uint64_t at = 0;
  while (at + sizeof(Elf64_Nhdr) <= notes.size()) {
    Elf64_Nhdr h{};
    std::memcpy(&h, notes.data() + at, sizeof h);
    // The descriptor and the next note start at the alignment, counted from the note's start.
    const uint64_t name_at = at + sizeof h;
    const uint64_t desc_at = at + align_up(sizeof h + uint64_t{h.n_namesz}, align);
    const uint64_t next = align_up(desc_at + uint64_t{h.n_descsz}, align);
    // n_namesz and n_descsz are 32-bit: these sums cannot overflow 64 bits.
    if (desc_at > notes.size() || h.n_descsz > notes.size() - desc_at) return std::nullopt;
    if (h.n_type == NT_GNU_BUILD_ID && h.n_namesz == 4 &&
        std::memcmp(notes.data() + name_at, "GNU", 4) == 0 && h.n_descsz > 0 &&
        h.n_descsz <= kMaxBuildIdBytes) {
      static constexpr char kHex[] = "0123456789abcdef";
      std::string hex;
      for (uint32_t i = 0; i < h.n_descsz; ++i) {
        const unsigned char b = notes[desc_at + i];
        hex += kHex[b >> 4];
        hex += kHex[b & 0xf];
      }
      return hex;
    }
    at = next;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> gnu_build_id(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  const auto file_size = static_cast<uint64_t>(st.st_size);
  Elf64_Ehdr eh{};
  if (!read_at(fd, &eh, sizeof eh, 0)) return std::nullopt;
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 ||
      eh.e_ident[EI_DATA] != ELFDATA2LSB || eh.e_phentsize != sizeof(Elf64_Phdr) ||
      eh.e_phnum == 0 || eh.e_phnum > kMaxProgramHeaders ||
      !within(eh.e_phoff, uint64_t{eh.e_phnum} * sizeof(Elf64_Phdr), file_size)) {
    return std::nullopt;
  }
  std::vector<Elf64_Phdr> headers(eh.e_phnum);
  if (!read_at(fd, headers.data(), headers.size() * sizeof(Elf64_Phdr), eh.e_phoff)) {
    return std::nullopt;
  }
  for (const auto& ph : headers) {
    if (ph.p_type != PT_NOTE || ph.p_filesz == 0) continue;
    if (ph.p_filesz > kMaxNoteSegmentBytes || !within(ph.p_offset, ph.p_filesz, file_size)) {
      return std::nullopt;
    }
    std::vector<unsigned char> notes(ph.p_filesz);
    if (!read_at(fd, notes.data(), notes.size(), ph.p_offset)) return std::nullopt;
    // Notes in a segment aligned to 8 are padded to 8 (.note.gnu.property), otherwise to 4.
    if (auto id = build_id_in(notes, ph.p_align == 8 ? 8 : 4)) return id;
  }
  return std::nullopt;
}

}  // namespace gpusnap::container
